"""A fixed pool of KV cache blocks: ref counts, an LRU free list, and prefix caching.

A full block is identified by a chained hash of (parent block's hash, the block's token ids).
Requests whose prompts share a prefix find those blocks by hash and share them (ref count > 1),
skipping their prefill. A hit is confirmed against the stored parent hash and token ids, so a hash
collision is a miss, never a wrong reuse. Freed blocks keep their contents and hash on the free
list until reused; the least recently freed block is reused (and its hash evicted) first.
"""

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = int
HashFn = Callable[[BlockHash | None, tuple[int, ...]], BlockHash]


def default_block_hash(parent: BlockHash | None, tokens: tuple[int, ...]) -> BlockHash:
    return hash((parent, tokens))


@dataclass
class BlockMeta:
    ref_count: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Hands out block ids 0 .. num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = default_block_hash) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [BlockMeta() for _ in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.num_queries = 0  # tokens looked up in the prefix cache
        self.num_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a request."""
        return 1.0 - len(self.free) / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self.blocks[block].ref_count

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free list (ref count 1 each)."""
        if count > len(self.free):
            raise RuntimeError(f"KV block pool exhausted: need {count}, have {len(self.free)}")
        out = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            meta = self.blocks[block]
            if meta.block_hash is not None and self.cached.get(meta.block_hash) == block:
                del self.cached[meta.block_hash]  # evict: the block gets new contents
            self.blocks[block] = BlockMeta(ref_count=1)
            out.append(block)
        return out

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each; blocks at zero join the tail of the free list.

        Pass a request's blocks last-first, so the tail of a sequence is evicted before its
        (more shareable) head.
        """
        for block in blocks:
            meta = self.blocks[block]
            if meta.ref_count <= 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            meta.ref_count -= 1
            if meta.ref_count == 0:
                self.free[block] = None

    def chain_hashes(self, token_ids: Sequence[int], num_full_blocks: int,
                     known: list[BlockHash]) -> list[BlockHash]:
        """Extend `known` (hashes of the first blocks) to the first num_full_blocks blocks."""
        hashes = list(known)
        bs = self.block_size
        for k in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(self.hash_fn(parent, tuple(token_ids[k * bs : (k + 1) * bs])))
        return hashes

    def prefix_hits(self, token_ids: Sequence[int], hashes: list[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of full blocks (at least one token left
        over), without taking references or counting a query; extends `hashes` (the request's
        chain) to every full block but the last token's."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes[:] = self.chain_hashes(token_ids, max_blocks, hashes)
        bs = self.block_size
        hits = []
        for k in range(max_blocks):
            block = self.cached.get(hashes[k])
            if block is None:
                break
            meta = self.blocks[block]
            parent = hashes[k - 1] if k else None
            if meta.parent_hash != parent or meta.token_ids != tuple(
                    token_ids[k * bs : (k + 1) * bs]):
                break  # a hash collision: treat as a miss
            hits.append(block)
        return hits

    def lookup_prefix(self, token_ids: Sequence[int], hashes: list[BlockHash]) -> list[int]:
        """Cached blocks for the longest prefix of full blocks (at least one token left over).

        Takes a reference on every block returned. `hashes` is the request's chain (extended).
        """
        if not self.enable_prefix_caching:
            return []
        hits = self.prefix_hits(token_ids, hashes)
        self.num_queries += len(token_ids)
        self.num_hits += len(hits) * self.block_size
        for block in hits:
            meta = self.blocks[block]
            if meta.ref_count == 0:
                del self.free[block]
            meta.ref_count += 1
        return hits

    def has_new_full_blocks(self, num_computed_tokens: int, num_registered: int) -> bool:
        """Whether `cache_full_blocks` would register anything (cheap: no token ids needed)."""
        return (self.enable_prefix_caching
                and num_computed_tokens // self.block_size > num_registered)

    def cache_full_blocks(self, token_ids: Sequence[int], block_ids: Sequence[int],
                          num_computed_tokens: int, hashes: list[BlockHash],
                          num_registered: int) -> int:
        """Register the request's computed full blocks from index num_registered on.

        Returns the new number of registered blocks.
        """
        if not self.has_new_full_blocks(num_computed_tokens, num_registered):
            return num_registered
        num_full = num_computed_tokens // self.block_size
        hashes[:] = self.chain_hashes(token_ids, num_full, hashes)
        bs = self.block_size
        for k in range(num_registered, num_full):
            meta = self.blocks[block_ids[k]]
            if meta.block_hash is not None:
                continue
            if hashes[k] in self.cached:
                continue  # another block (or a colliding one) already holds this hash
            meta.block_hash = hashes[k]
            meta.parent_hash = hashes[k - 1] if k else None
            meta.token_ids = tuple(token_ids[k * bs : (k + 1) * bs])
            self.cached[hashes[k]] = block_ids[k]
        return num_full
