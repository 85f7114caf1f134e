"""A fixed pool of KV cache blocks with reference counts and a free list."""

from collections import OrderedDict


class BlockPool:
    """Hands out block ids 0 .. num_blocks-1; a block returns to the free list at ref count 0.

    The free list is ordered: blocks freed first are reused first.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (ref count 1 each); raises if the pool has fewer."""
        if count > len(self.free):
            raise RuntimeError(f"KV block pool exhausted: need {count}, have {len(self.free)}")
        blocks = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free_blocks(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks at zero go to the back of the free list."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            if self.ref_counts[block] == 0:
                self.free[block] = None

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self.free) / self.num_blocks
