"""The cells of the MLA decode sweep, its presets (anchor, coverage), and the roofline of one
cell.

A cell is one decode problem: `batch_size` requests of `kv_len` cached tokens each (the q_len new
tokens included), or, `ragged`, lengths drawn uniformly from q_len..kv_len (fixed per cell);
`num_heads` query heads, pages of `block_size` tokens, `q_len` new tokens per request. Its floor
(docs/architecture.md, "Tests and benchmarks") is max(bytes / copy rate, flops / matmul rate)
with, for N = the sum of the lengths,

    bytes = N * (L + R) * e + B * q_len * H * (L + R + L) * e   (cache read once, q in, o out)
    flops = 2 * q_len * H * N * (L + R + L)                     (Q K^T over L + R, P V over L)

where e is the element size (2 for bfloat16).
"""

import bisect
import itertools
import random
from dataclasses import dataclass

from mlaserve.engine.cuda_graphs import capture_sizes
from mlaserve.engine.decode_record import DecodeStep


@dataclass(frozen=True)
class Cell:
    """One decode problem of the sweep."""

    num_heads: int
    batch_size: int
    kv_len: int
    block_size: int
    q_len: int = 1
    ragged: bool = False
    # a served step's lengths (`replay_cells`): the batch as recorded, one length per request
    # (then 0 for each row its decode graph had past them)
    lengths: tuple[int, ...] | None = None
    step: int = -1  # the recorded step's index (a replayed cell)
    # the length bound the server planned the step for (its graph's covered length); None:
    # the cell's own longest length
    plan_len: int | None = None

    @property
    def label(self) -> str:
        if self.lengths is not None:
            return (f"H{self.num_heads} B{self.batch_size} kv{min(self.lengths)}..{self.kv_len} "
                    f"blk{self.block_size} q{self.q_len} step{self.step}")
        kv = f"kv{self.q_len}..{self.kv_len}" if self.ragged else f"kv{self.kv_len}"
        return f"H{self.num_heads} B{self.batch_size} {kv} blk{self.block_size} q{self.q_len}"

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.kv_len // self.block_size)

    def seq_lens(self) -> list[int]:
        """The KV length of each request: kv_len, or drawn from q_len..kv_len when ragged (the
        same draw for a cell in every run), or a replayed step's lengths."""
        if self.lengths is not None:
            return list(self.lengths)
        if not self.ragged:
            return [self.kv_len] * self.batch_size
        draw = random.Random(f"{self.batch_size}x{self.kv_len}x{self.q_len}")
        return [draw.randint(self.q_len, self.kv_len) for _ in range(self.batch_size)]

    def sort_key(self) -> tuple[int, int, int, int, bool, int, int]:
        """Table order: q_len, heads, batch, kv length, uniform before ragged, larger blocks
        first."""
        return (self.q_len, self.num_heads, self.batch_size, self.kv_len, self.ragged,
                -self.block_size, self.step)


def replay_cells(steps: list[DecodeStep], num_heads: int, block_size: int, max_steps: int,
                 graph_len: int | None = None) -> list[Cell]:
    """Cells of recorded decode steps (`engine.decode_record.read_decode_steps`): at most
    `max_steps` of them, evenly spaced over the record (its first and last included), each
    with its batch's own lengths, planned as the server planned it: rows of length 0 up to
    the recorded plan's batch size (a decode graph's padding), and its length bound.

    graph_len: for steps recorded without their plan, plan them as a decode graph covering
    this many tokens would (the engine's capture sizes, up to the record's largest batch
    rounded up to 8; `--max-seq-len-to-capture`); None: at their own sizes.
    """
    if not steps:
        raise ValueError("the decode-step record is empty")
    count = min(max_steps, len(steps))
    picks = sorted({round(i * (len(steps) - 1) / max(count - 1, 1)) for i in range(count)})
    largest = -(-max(len(step.seq_lens) for step in steps) // 8) * 8
    sizes = capture_sizes(largest)
    cells = []
    for i in picks:
        step = steps[i]
        batch, plan_batch, plan_len = len(step.seq_lens), step.plan_batch, step.plan_len
        if plan_batch is None and graph_len is not None and max(step.seq_lens) <= graph_len:
            plan_batch, plan_len = sizes[bisect.bisect_left(sizes, batch)], graph_len
        lengths = tuple(step.seq_lens) + (0,) * ((plan_batch or batch) - batch)
        cells.append(Cell(num_heads, len(lengths), max(lengths), block_size, step.q_len,
                          lengths=lengths, step=i, plan_len=plan_len))
    return cells


def decode_bytes(cell: Cell, kv_lora_rank: int, rope_dim: int, element_size: int = 2) -> int:
    """Fewest bytes one decode call moves: the cache once, q in and o out."""
    head_dim = kv_lora_rank + rope_dim
    cache = sum(cell.seq_lens()) * head_dim
    q_and_o = cell.batch_size * cell.q_len * cell.num_heads * (head_dim + kv_lora_rank)
    return (cache + q_and_o) * element_size


def decode_flops(cell: Cell, kv_lora_rank: int, rope_dim: int) -> int:
    """Matmul flops of one decode call: S = Q K^T over L + R columns, O = P V over L."""
    head_dim = kv_lora_rank + rope_dim
    return 2 * cell.q_len * cell.num_heads * sum(cell.seq_lens()) * (head_dim + kv_lora_rank)


def floor_seconds(num_bytes: int, flops: int, copy_bytes_per_s: float,
                  matmul_flops_per_s: float) -> float:
    """max(bytes / copy rate, flops / matmul rate): no kernel runs much faster than this."""
    return max(num_bytes / copy_bytes_per_s, flops / matmul_flops_per_s)


def flag_cells(heads: list[int], batch_sizes: list[int], kv_lens: list[int],
               block_sizes: list[int], q_lens: list[int]) -> list[Cell]:
    """The product of the grid flags, sorted."""
    cells = {Cell(h, b, kv, blk, q) for h, b, kv, blk, q in
             itertools.product(heads, batch_sizes, kv_lens, block_sizes, q_lens)}
    return sorted(cells, key=Cell.sort_key)


def anchor_cells() -> list[Cell]:
    """The reference grid of DeepSeek decode shapes (FlashInfer's numbers on an H200 exist for it).

    heads {16, 128} x batch {1, 64, 512} x kv {1024, 4096} at block 64, batch 1 also at kv 8192,
    16 heads x batch 512 x kv 4096 also at block 32, and q_len 2 and 4 at 16 x 64 x 4096.
    """
    cells = set(flag_cells([16, 128], [1, 64, 512], [1024, 4096], [64], [1]))
    cells |= {Cell(heads, 1, 8192, 64) for heads in (16, 128)}
    cells.add(Cell(16, 512, 4096, 32))
    cells |= {Cell(16, 64, 4096, 64, q_len) for q_len in (2, 4)}
    return sorted(cells, key=Cell.sort_key)


def coverage_cells() -> list[Cell]:
    """The anchor cells plus what serving adds: page sizes and ragged batches.

    Block sizes 16, 32 and 128 at 16 heads x batch {1, 64, 512} x kv 4096 (block 64 is in the
    anchor grid), and ragged batches (lengths drawn from 1..8192) at heads {16, 128} x batch
    {16, 64, 128, 256, 512}, block 64 (the table's plan line names each cell's split policy).
    """
    cells = set(anchor_cells())
    cells |= set(flag_cells([16], [1, 64, 512], [4096], [16, 32, 128], [1]))
    cells |= {Cell(heads, batch, 8192, 64, ragged=True) for heads in (16, 128)
              for batch in (16, 64, 128, 256, 512)}
    return sorted(cells, key=Cell.sort_key)
