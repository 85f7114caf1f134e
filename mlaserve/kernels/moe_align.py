"""Grouping a step's (token, slot) pairs by expert on the device, for the fused MoE kernels.

Each expert's pairs fill a run of rows padded to a multiple of BLOCK_M, so every M-block of rows
belongs to one expert. Three small launches build the layout without a host sync: per-chunk
expert counts, one program turning them into each chunk's destination offsets (and the expert of
every M-block), then the scatter; when the pairs fit one chunk (decode steps) one program does
all three. The layout's size is a static bound, so every launch is fixed by host-side shapes and
can be captured in a CUDA graph.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.kernels.interpreter import prepare_launch


class ExpertAlignment(NamedTuple):
    """The (token, slot) pairs grouped by expert, each expert's run padded to block_m rows.

    sorted_ids: [max_padded] int32, pair ids t * K + k, ascending within an expert; padding
        rows (and rows past num_padded) hold the sentinel T * K.
    expert_ids: [ceil(max_padded / block_m)] int32, the expert of each M-block; -1 past
        num_padded.
    num_padded: [1] int32, the valid rows (a multiple of block_m).
    max_padded = T * K + min(E, T * K) * (block_m - 1) bounds the valid rows for any routing.
    """

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


# Integer arguments that vary with the step's token count are not specialised (Triton would
# compile a variant per value class: equal to 1, divisible by 16, other), so one compiled kernel
# per configuration serves every step size and a server compiles nothing after its warm-up.
@triton.jit(do_not_specialize=["num_pairs", "max_padded", "fill_per_chunk"])
def _count_kernel(
    topk_ids_ptr,  # [T * K] int64
    chunk_counts_ptr,  # [num_chunks, EXPERTS] int32, out
    sorted_ids_ptr,  # [max_padded] int32, out: this program's share set to the sentinel
    num_pairs,
    max_padded,
    fill_per_chunk,
    CHUNK: tl.constexpr,
    EXPERTS: tl.constexpr,
    FILL_TILE: tl.constexpr,
):
    """Pairs per expert in one chunk of CHUNK pairs; fills a share of sorted_ids with T * K."""
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    experts = tl.arange(0, EXPERTS)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EXPERTS]
    tl.store(chunk_counts_ptr + chunk * EXPERTS + experts, tl.sum(hits, axis=0))
    fill_start = chunk * fill_per_chunk
    fill_end = tl.minimum(fill_start + fill_per_chunk, max_padded)
    sentinel = tl.zeros([FILL_TILE], dtype=tl.int32) + num_pairs
    for start in range(fill_start, fill_end, FILL_TILE):
        rows = start + tl.arange(0, FILL_TILE)
        tl.store(sorted_ids_ptr + rows, sentinel, mask=rows < fill_end)


@triton.jit(do_not_specialize=["num_chunks", "num_m_blocks"])
def _offsets_kernel(
    chunk_counts_ptr,  # [num_chunks, EXPERTS] int32: counts in, each chunk's first row out
    expert_ids_ptr,  # [num_m_blocks] int32, out
    num_padded_ptr,  # [1] int32, out
    num_chunks,
    num_experts,
    num_m_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,
    CHUNK_TILE: tl.constexpr,
    M_BLOCK_TILE: tl.constexpr,
):
    """One program: the padded run of each expert, the row where each chunk's pairs of each
    expert start, and the expert of each M-block."""
    experts = tl.arange(0, EXPERTS)
    totals = tl.zeros([EXPERTS], dtype=tl.int32)
    for start in range(0, num_chunks, CHUNK_TILE):
        chunks = start + tl.arange(0, CHUNK_TILE)
        ptrs = chunk_counts_ptr + chunks[:, None] * EXPERTS + experts[None, :]
        totals += tl.sum(tl.load(ptrs, mask=(chunks < num_chunks)[:, None], other=0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [EXPERTS] end row of each expert's run
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    next_row = ends - padded  # [EXPERTS] first row of each expert's run not yet given out
    for start in range(0, num_chunks, CHUNK_TILE):
        chunks = start + tl.arange(0, CHUNK_TILE)
        ptrs = chunk_counts_ptr + chunks[:, None] * EXPERTS + experts[None, :]
        mask = (chunks < num_chunks)[:, None]
        counts = tl.load(ptrs, mask=mask, other=0)  # [CHUNK_TILE, EXPERTS]
        tl.store(ptrs, next_row[None, :] + tl.cumsum(counts, axis=0) - counts, mask=mask)
        next_row += tl.sum(counts, axis=0)
    # An M-block's expert is the number of runs that end at or before its first row (empty
    # runs end where they start); past the last run that count reaches EXPERTS.
    for start in range(0, num_m_blocks, M_BLOCK_TILE):
        blocks = start + tl.arange(0, M_BLOCK_TILE)
        ended = (ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32)  # [TILE, EXPERTS]
        owner = tl.sum(ended, axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(owner < num_experts, owner, -1),
                 mask=blocks < num_m_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(
    topk_ids_ptr,  # [T * K] int64
    chunk_offsets_ptr,  # [num_chunks, EXPERTS] int32
    sorted_ids_ptr,  # [max_padded] int32, out
    num_pairs,
    CHUNK: tl.constexpr,
    EXPERTS: tl.constexpr,
):
    """Each pair of one chunk to its row: its chunk's first row for the expert plus its rank
    among the chunk's pairs of that expert (pair order is kept within an expert)."""
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1).to(tl.int32)
    experts = tl.arange(0, EXPERTS)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EXPERTS]
    offsets = tl.load(chunk_offsets_ptr + chunk * EXPERTS + experts)
    rows = tl.sum(hits * (offsets[None, :] + tl.cumsum(hits, axis=0) - 1), axis=1)
    tl.store(sorted_ids_ptr + rows, pairs, mask=valid & (ids >= 0))  # -1: unrouted, no row


@triton.jit(do_not_specialize=["num_pairs", "max_padded", "num_m_blocks"])
def _align_one_program_kernel(
    topk_ids_ptr,  # [T * K] int64
    sorted_ids_ptr,  # [max_padded] int32, out
    expert_ids_ptr,  # [num_m_blocks] int32, out
    num_padded_ptr,  # [1] int32, out
    num_pairs,
    num_experts,
    max_padded,
    num_m_blocks,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
    EXPERTS: tl.constexpr,
    FILL_TILE: tl.constexpr,
    M_BLOCK_TILE: tl.constexpr,
):
    """The three alignment kernels in one program, for at most PAIRS pairs (decode steps):
    count per expert, pad the runs, fill sorted_ids with the sentinel, place each pair at its
    run's start plus its rank within the expert, and give each M-block its expert."""
    pairs = tl.arange(0, PAIRS)
    valid = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1).to(tl.int32)
    experts = tl.arange(0, EXPERTS)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)  # [PAIRS, EXPERTS]
    counts = tl.sum(hits, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [EXPERTS] end row of each expert's run
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    sentinel = tl.zeros([FILL_TILE], dtype=tl.int32) + num_pairs
    for start in range(0, max_padded, FILL_TILE):
        rows = start + tl.arange(0, FILL_TILE)
        tl.store(sorted_ids_ptr + rows, sentinel, mask=rows < max_padded)
    tl.debug_barrier()  # the sentinel stores land before the pairs overwrite some of them
    rows = tl.sum(hits * ((ends - padded)[None, :] + tl.cumsum(hits, axis=0) - 1), axis=1)
    tl.store(sorted_ids_ptr + rows, pairs, mask=valid & (ids >= 0))  # -1: unrouted, no row
    for start in range(0, num_m_blocks, M_BLOCK_TILE):  # as in `_offsets_kernel`
        blocks = start + tl.arange(0, M_BLOCK_TILE)
        ended = (ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32)  # [TILE, EXPERTS]
        owner = tl.sum(ended, axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(owner < num_experts, owner, -1),
                 mask=blocks < num_m_blocks)


def _loop_tile(num_rows: int, experts: int) -> int:
    """Rows of a [rows, EXPERTS] tile that the offsets kernel loops over: 32 for up to 32 rows
    (decode), else about 16K elements; two sizes, so two compiled variants at most."""
    large = max(1, 16384 // experts)
    return min(32, large) if num_rows <= 32 else large


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Group the (token, slot) pairs by expert, each run padded to block_m rows, on the device.

    Args:
        topk_ids: [T, K] int64 (any integer dtype), every id in [0, num_experts) or -1 (an
            unrouted pair: it gets no row).

    Returns:
        The `ExpertAlignment`; no host sync. One launch when the pairs fit one chunk (decode
        steps), else three (count per chunk, offsets, scatter).
    """
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat_ids = topk_ids.reshape(num_pairs)  # [T * K]
    max_padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_m_blocks = triton.cdiv(max_padded, block_m)
    experts = triton.next_power_of_2(num_experts)
    # [CHUNK, EXPERTS] and [CHUNK_TILE, EXPERTS] tiles of about 16K elements
    chunk = max(16, min(1024, 16384 // experts))
    num_chunks = triton.cdiv(num_pairs, chunk)
    chunk_tile = _loop_tile(num_chunks, experts)
    block_tile = _loop_tile(num_m_blocks, experts)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_m_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    prepare_launch(topk_ids)
    if num_chunks == 1:
        _align_one_program_kernel[(1,)](
            flat_ids, sorted_ids, expert_ids, num_padded, num_pairs, num_experts, max_padded,
            num_m_blocks, BLOCK_M=block_m, PAIRS=chunk, EXPERTS=experts, FILL_TILE=1024,
            M_BLOCK_TILE=block_tile, num_warps=4)
        return ExpertAlignment(sorted_ids, expert_ids, num_padded, block_m)
    chunk_counts = torch.empty(num_chunks, experts, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](
        flat_ids, chunk_counts, sorted_ids, num_pairs, max_padded,
        triton.cdiv(max_padded, num_chunks), CHUNK=chunk, EXPERTS=experts, FILL_TILE=1024,
        num_warps=4)
    _offsets_kernel[(1,)](
        chunk_counts, expert_ids, num_padded, num_chunks, num_experts, num_m_blocks,
        BLOCK_M=block_m, EXPERTS=experts, CHUNK_TILE=chunk_tile, M_BLOCK_TILE=block_tile,
        num_warps=4)
    _scatter_kernel[(num_chunks,)](
        flat_ids, chunk_counts, sorted_ids, num_pairs, CHUNK=chunk, EXPERTS=experts,
        num_warps=4)
    return ExpertAlignment(sorted_ids, expert_ids, num_padded, block_m)
