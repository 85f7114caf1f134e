"""Warp-specialised split pass of the paged MLA decode for 64-row programs on sm_90 (Gluon).

The same problem, split arithmetic (`splits.split_bounds`) and output layout as
`_mla_decode_split_kernel` in `triton_split.py` (the merge kernel of `merge.py` finishes the
job, launched by `launch.py` where the plan names `GLUON_SM90`), for 64 query rows per program
(128 heads, or 16 heads x q_len 2-4 padded to 64 rows) with kv_lora_rank 512 and 16-bit data.
Triton's pipeliner keeps a 64-row program's two warpgroups in lockstep and leaves the tensor
cores idle during the softmax; here the work is laid out by hand, in three partitions:

- A 1-warp loader issues TMA copies: the program's Q rows [64, L] and [64, R] once, then each
  KV tile [BLOCK_N, L] and [BLOCK_N, R] of the split (one page id per tile) into a ring of
  NUM_STAGES shared buffers guarded by ready / empty mbarriers.
- Two compute warpgroups, each its own partition, alternate over pairs of tiles (the "seesaw"
  schedule of FlashMLA's sm_90 kernel, written here for Gluon):
  - The output O [64, L] is split by columns: warpgroup 0 holds O_L = O[:, :L/2], warpgroup 1
    O_R = O[:, L/2:], both float32 in registers. Both keep the running row max m.
  - Tiles come in pairs (a = 2i, b = 2i + 1). Warpgroup 0 computes S_a = Q K_a^T, warpgroup 1
    S_b = Q K_b^T, each the whole [64, BLOCK_N] product (no exchange inside a product).
  - Warpgroup 0: m_a = max(m, rowmax S_a) (published), P_a = exp2(S_a - m_a),
    O_L = O_L exp2(m - m_a) + P_a V_aL. Warpgroup 1 reads m_a: m_b = max(m_a, rowmax S_b)
    (published), P_b = exp2(S_b - m_b), O_R = O_R exp2(m - m_b) + P_b V_bR, and shares P_b.
  - Warpgroup 0 reads m_b, c = exp2(m_a - m_b), shares P_a c and sets O_L = O_L c + P_b V_bL;
    warpgroup 1 adds O_R += (P_a c) V_aR. Both end the pair at m = m_b.
  - The shared P tiles [64, BLOCK_N] are written over the tile's own rope columns K_pe
    [BLOCK_N, R] (the same bytes for R >= 64): S is done with them, and the buffer goes back
    to the loader only once both warpgroups are done with the pair.
  - The row sums l are kept per warpgroup (l_L over the a tiles, l_R over the b tiles, in the
    same frame m) and added at the end. An odd last tile is a pair without b.
  While one warpgroup runs its softmax, the other's products keep the tensor cores busy; with
  32-token tiles and 4 buffers the next pair's tiles load while the current pair is computed.
- V is the [BLOCK_N, L] buffer of the tile itself. A split's partial last tile has its rows
  past the length zeroed in shared memory (each warpgroup its half) before any product reads
  it: the page tail may hold NaN, and P = 0 times NaN is NaN. Their scores are masked to -inf
  like every invisible key.
- The output leaves by TMA where the program's 64 rows are all real (q_len * H a multiple of
  64) and the ring holds [64, L] of the output dtype: each warpgroup writes its half into the
  ring (free once both have passed the last tile) and stores it as one box, instead of
  storing straight from the wgmma layout (two adjacent columns per thread).

Over an FP8 cache (FP8_STAGES > 0) a partition of 4 converter warps takes the loader's
place (`gluon_sm90_tiles.converter_partition`): it copies Q and FP8 tiles by TMA, the tiles
into a staging ring of FP8_STAGES buffers, makes Q float16 in place and converts each FP8
tile once into the ring above, in float16 (one conversion instruction per two values;
bfloat16 would take three per two values on the SM's slow conversion units); the compute
warpgroups are the same, on float16 operands. Q [64, L + R] and 3 converted tiles of 32
tokens plus 2 FP8 ones fill the shared memory (`common.gluon_shared_memory_bytes`). Rounding
a bfloat16 q to float16 is what the other FP8 passes do (`MLADecodePlan.fp16_dots`).

Scores are computed in base 2 (qk_scale = softmax_scale * log2(e)); lse is returned in natural
log. Needs triton.experimental.gluon (Triton >= 3.6) and an sm_90 GPU; the plan chooses this
pass only where `common.gluon_serves` holds.
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mlaserve.kernels.mla_decode.common import GLUON_BLOCK_M, SplitPassIO
from mlaserve.kernels.mla_decode.gluon_sm90_tiles import (
    CONVERT_WARPS,
    converter_partition,
    exp_scores,
    issue_scores,
    loader_partition,
    masked_scores,
    shared_p,
    store_half_by_tma,
    wgmma_layout,
    zero_tail,
)
from mlaserve.kernels.mla_decode.plan import MLADecodePlan
from mlaserve.kernels.mla_decode.splits import split_bounds

BLOCK_M = GLUON_BLOCK_M  # query rows per program
NUM_WARPS = 4  # per compute partition: one warpgroup
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
              torch.float32: gl.float32, torch.float8_e4m3fn: gl.float8e4nv}
# Registers a thread (setmaxnreg) of the second compute warpgroup and of the loader warp; the
# first warpgroup gets the rest of the 64K. Over an FP8 cache the converter warps replace the
# loader and the second compute warpgroup takes fewer, so that neither compute warpgroup
# spills (the compiled kernel's stack is checked in tests/kernels/test_mla_decode_gluon_sm90.py).
COMPUTE_REGISTERS = gl.constexpr(224)
LOADER_REGISTERS = gl.constexpr(24)
FP8_COMPUTE_REGISTERS = gl.constexpr(208)
CONVERTER_REGISTERS = gl.constexpr(48)


@gluon.jit
def _pair_step(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, stats_smem, kv_ready, kv_empty,
               max_ready, p_ready, acc, m_i, l_i, i, last_key, qk_scale, split_start, split_end,
               num_tiles, HALF: gl.constexpr, ZERO_TAIL: gl.constexpr):
    """Pair i (tiles 2i, 2i + 1) for one warpgroup: returns its acc, m_i, l_i. ZERO_TAIL: the
    pair holds the split's partial last tile (kept out of the loop body: its zeroing would
    cost registers the loop needs)."""
    STAGES: gl.constexpr = kv_nope_smem.type.shape[0]
    TILE: gl.constexpr = kv_nope_smem.type.shape[1]
    COLS: gl.constexpr = kv_nope_smem.type.shape[2] // 2
    ROWS: gl.constexpr = q_nope_smem.type.shape[0]
    dtype: gl.constexpr = kv_nope_smem.type.element_ty
    S_LAYOUT: gl.constexpr = wgmma_layout(TILE)
    O_LAYOUT: gl.constexpr = wgmma_layout(COLS)
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    if ZERO_TAIL:  # once tile 2i + 1 has landed (S sees zeros only in rows it masks)
        zero_tail(kv_nope_smem, kv_ready, num_tiles, split_start, split_end, HALF)
    own = 2 * i + HALF
    other = 2 * i + 1 - HALF
    own_stage = own % STAGES
    other_stage = other % STAGES
    token = issue_scores(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, kv_ready, own,
                         S_LAYOUT)
    scores = masked_scores(warpgroup_mma_wait(0, deps=[token]), split_start + own * TILE,
                           split_end, last_key, qk_scale)
    if HALF == 0:
        m_own = gl.maximum(m_i, gl.max(scores, axis=1))
        stats_smem.index(0).store(m_own)
        mbarrier.arrive(max_ready.index(0))
    else:
        mbarrier.wait(max_ready.index(0), i & 1)
        m_own = gl.maximum(stats_smem.index(0).load(ROW_S), gl.max(scores, axis=1))
        stats_smem.index(1).store(m_own)
        mbarrier.arrive(max_ready.index(1))
    alpha, p, l_i = exp_scores(scores, m_i, m_own, l_i)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
    p_regs = gl.convert_layout(p.to(dtype), P_LAYOUT)
    own_v = kv_nope_smem.index(own_stage).slice(HALF * COLS, COLS, dim=1)
    o_token = warpgroup_mma(p_regs, own_v, acc, is_async=True)
    if HALF == 0:
        mbarrier.wait(max_ready.index(1), i & 1)
        m_pair = stats_smem.index(1).load(ROW_S)
        # m_pair = -inf only where m_own is too (the product is 0 there).
        c = gl.exp2(m_own - gl.where(m_pair == float("-inf"), 0.0, m_pair))
        shared_p(kv_pe_smem, own_stage, ROWS).store(
            (p * gl.expand_dims(c, 1)).to(dtype))
        fence_async_shared()
        mbarrier.arrive(p_ready.index(0))
        acc, p_regs = warpgroup_mma_wait(0, deps=[o_token, p_regs])
        acc = acc * gl.expand_dims(gl.convert_layout(c, ROW_O), 1)
        l_i = l_i * c
        m_i = m_pair
    else:
        shared_p(kv_pe_smem, own_stage, ROWS).store(p.to(dtype))
        fence_async_shared()
        mbarrier.arrive(p_ready.index(1))
        acc, p_regs = warpgroup_mma_wait(0, deps=[o_token, p_regs])
        m_i = m_own
    mbarrier.wait(p_ready.index(1 - HALF), i & 1)
    other_v = kv_nope_smem.index(other_stage).slice(HALF * COLS, COLS, dim=1)
    p_other = shared_p(kv_pe_smem, other_stage, ROWS)
    o_token = warpgroup_mma(p_other, other_v, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[o_token])
    mbarrier.arrive(kv_empty.index(own_stage))
    mbarrier.arrive(kv_empty.index(other_stage))
    return acc, m_i, l_i


@gluon.jit
def _seesaw_partition(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, stats_smem, q_ready,
                      kv_ready, kv_empty, max_ready, p_ready, sum_ready, o_desc, o_ptr,
                      lse_ptr, qk_scale, q_len, num_heads, num_rows, group, out_base, seq_len,
                      split_start, split_end, num_tiles, HALF: gl.constexpr,
                      DIRECT_OUTPUT: gl.constexpr, TMA_STORE: gl.constexpr):
    """One compute warpgroup (HALF 0: the a tiles and O_L; 1: the b tiles and O_R)."""
    STAGES: gl.constexpr = kv_nope_smem.type.shape[0]
    TILE: gl.constexpr = kv_nope_smem.type.shape[1]
    L: gl.constexpr = kv_nope_smem.type.shape[2]
    COLS: gl.constexpr = L // 2
    ROWS: gl.constexpr = q_nope_smem.type.shape[0]
    dtype: gl.constexpr = kv_nope_smem.type.element_ty
    S_LAYOUT: gl.constexpr = wgmma_layout(TILE)
    O_LAYOUT: gl.constexpr = wgmma_layout(COLS)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

    rows_s = group * ROWS + gl.arange(0, ROWS, layout=ROW_S)  # row r = t * H + h
    last_key = seq_len - q_len + rows_s // num_heads  # [64]
    m_i = gl.full([ROWS], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([ROWS], gl.float32, ROW_S)  # this warpgroup's tiles only
    acc = gl.zeros([ROWS, COLS], gl.float32, O_LAYOUT)
    mbarrier.wait(q_ready, 0)
    # Pairs of whole tiles; a partial last tile comes after the loop (in the last pair, or
    # alone when the count is odd).
    num_pairs = num_tiles // 2
    tail_pair = (num_tiles % 2 == 0) & ((split_end - split_start) % TILE != 0)
    for i in range(num_pairs - tail_pair.to(gl.int32)):
        acc, m_i, l_i = _pair_step(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, stats_smem,
                                   kv_ready, kv_empty, max_ready, p_ready, acc, m_i, l_i, i,
                                   last_key, qk_scale, split_start, split_end, num_tiles, HALF,
                                   False)
    if tail_pair & (num_pairs > 0):
        acc, m_i, l_i = _pair_step(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, stats_smem,
                                   kv_ready, kv_empty, max_ready, p_ready, acc, m_i, l_i,
                                   num_pairs - 1, last_key, qk_scale, split_start, split_end,
                                   num_tiles, HALF, True)

    if num_tiles % 2 == 1:  # a last pair without b: warpgroup 0 computes, both add P_a V_a
        last = num_tiles - 1
        stage = last % STAGES
        phase = num_pairs & 1
        zero_tail(kv_nope_smem, kv_ready, num_tiles, split_start, split_end, HALF)
        if HALF == 0:
            token = issue_scores(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, kv_ready,
                                 last, S_LAYOUT)
            scores = masked_scores(warpgroup_mma_wait(0, deps=[token]),
                                   split_start + last * TILE, split_end, last_key, qk_scale)
            m_own = gl.maximum(m_i, gl.max(scores, axis=1))
            stats_smem.index(0).store(m_own)
            mbarrier.arrive(max_ready.index(0))
            alpha, p, l_i = exp_scores(scores, m_i, m_own, l_i)
            shared_p(kv_pe_smem, stage, ROWS).store(p.to(dtype))
            fence_async_shared()
            mbarrier.arrive(p_ready.index(0))
            m_i = m_own
        else:
            mbarrier.wait(max_ready.index(0), phase)
            m_own = stats_smem.index(0).load(ROW_S)
            alpha = gl.exp2(m_i - gl.where(m_own == float("-inf"), 0.0, m_own))
            l_i = l_i * alpha
            m_i = m_own
            mbarrier.wait(p_ready.index(0), phase)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
        v = kv_nope_smem.index(stage).slice(HALF * COLS, COLS, dim=1)
        o_token = warpgroup_mma(shared_p(kv_pe_smem, stage, ROWS), v, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_token])
        mbarrier.arrive(kv_empty.index(stage))

    # l = l_L + l_R: each warpgroup publishes its sum, then reads the other's.
    stats_smem.index(2 + HALF).store(l_i)
    mbarrier.arrive(sum_ready)
    mbarrier.wait(sum_ready, 0)
    l_i = l_i + stats_smem.index(3 - HALF).load(ROW_S)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, ROW_O), 1)
    if TMA_STORE:
        store_half_by_tma(out, o_desc, kv_nope_smem, (out_base + group * ROWS).to(gl.int32),
                           HALF)
    else:
        rows_o = group * ROWS + gl.arange(0, ROWS, layout=ROW_O)
        cols = HALF * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, O_LAYOUT))
        o_offs = gl.expand_dims((out_base + rows_o) * L, 1) + gl.expand_dims(cols, 0)
        row_ok = rows_o < num_rows  # a padded group's last rows belong to the next request
        if not DIRECT_OUTPUT:
            row_ok = row_ok & (gl.convert_layout(l_i, ROW_O) > 0.0)  # skipped by the merge
        o_mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < L, 0)
        gl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=o_mask)
    if HALF == 0:
        lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453  # natural log; -inf where no key
        gl.store(lse_ptr + out_base + rows_s, lse, mask=rows_s < num_rows)


@gluon.jit
def _mla_decode_split_kernel_sm90(
    q_nope_desc,  # q [B * q_len * H, L + R]: box [64, L] at column 0
    q_pe_desc,  # the same rows: box [64, R] at column L
    kv_nope_desc,  # cache [num_blocks * BLOCK_SIZE, L + R] (q's dtype or FP8): box [BLOCK_N, L]
    kv_pe_desc,  # the same rows: box [BLOCK_N, R] at column L
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    o_desc,  # o_ptr's rows [B * num_splits * q_len * H, L]: box [64, L / 2]
    o_ptr,  # [B, num_splits, q_len * H, L]: partial (float32) or final (q dtype) output
    lse_ptr,  # [B, num_splits, q_len * H] float32
    qk_scale,  # softmax_scale * log2(e)
    q_len,
    num_heads,
    num_splits,
    min_split_len,  # a multiple of BLOCK_N
    split_len_ptr,  # [1] int32: the step's least split length (BALANCED only; else unread)
    stride_bt,
    BLOCK_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    DIRECT_OUTPUT: gl.constexpr,
    BALANCED: gl.constexpr,  # balanced splits (common.py)
    TMA_STORE: gl.constexpr,  # full 64-row groups store by TMA through the KV ring
    FP8_STAGES: gl.constexpr,  # > 0: an FP8 cache, staged in this many FP8 tiles
):
    ROWS: gl.constexpr = q_nope_desc.block_type.shape[0]
    L: gl.constexpr = q_nope_desc.block_type.shape[1]
    TILE: gl.constexpr = kv_nope_desc.block_type.shape[0]
    group = gl.program_id(0)
    split = gl.program_id(1)
    req = gl.program_id(2)
    num_rows = q_len * num_heads
    seq_len = gl.load(seq_lens_ptr + req)
    balanced_len = 0
    if BALANCED:  # the step's split length, planned on the device (split_plan.py)
        balanced_len = gl.load(split_len_ptr)
    _, split_start, split_end = split_bounds(seq_len, split, num_splits, min_split_len, TILE,
                                             balanced_len)
    num_tiles = gl.cdiv(gl.maximum(split_end - split_start, 0), TILE)
    q_row = req * num_rows + group * ROWS
    out_base = (req.to(gl.int64) * num_splits + split) * num_rows  # first output row
    bt_row = block_table_ptr + req.to(gl.int64) * stride_bt

    R: gl.constexpr = q_pe_desc.block_type.shape[1]
    dtype: gl.constexpr = q_nope_desc.dtype
    q_nope_smem = gl.allocate_shared_memory(dtype, q_nope_desc.block_type.shape,
                                            q_nope_desc.layout)
    q_pe_smem = gl.allocate_shared_memory(dtype, q_pe_desc.block_type.shape, q_pe_desc.layout)
    # The tiles the products read, in q's dtype, float16 over an FP8 cache (Q's layouts: the
    # same 128-byte swizzle)
    if FP8_STAGES == 0:
        ring_dtype: gl.constexpr = dtype
    else:
        ring_dtype: gl.constexpr = gl.float16
    kv_nope_smem = gl.allocate_shared_memory(ring_dtype, [NUM_STAGES, TILE, L],
                                             q_nope_desc.layout)
    kv_pe_smem = gl.allocate_shared_memory(ring_dtype, [NUM_STAGES, TILE, R], q_pe_desc.layout)
    # Row statistics between the warpgroups: m_a, m_b, l_L, l_R.
    stats_smem = gl.allocate_shared_memory(gl.float32, [4, ROWS],
                                           gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    max_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    sum_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(i), count=1)  # the loader's copy or the converter
        mbarrier.init(kv_empty.index(i), count=2)  # both warpgroups release a tile
    for i in gl.static_range(2):
        mbarrier.init(max_ready.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
    mbarrier.init(sum_ready, count=2)
    fence_async_shared()

    LEFT: gl.constexpr = 0
    RIGHT: gl.constexpr = 1
    if FP8_STAGES == 0:
        gl.warp_specialize([
            (_seesaw_partition, (q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, stats_smem,
                                 q_ready, kv_ready, kv_empty, max_ready, p_ready, sum_ready,
                                 o_desc, o_ptr, lse_ptr, qk_scale, q_len, num_heads, num_rows,
                                 group, out_base, seq_len, split_start, split_end, num_tiles,
                                 LEFT, DIRECT_OUTPUT, TMA_STORE)),
            (_seesaw_partition, (q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, stats_smem,
                                 q_ready, kv_ready, kv_empty, max_ready, p_ready, sum_ready,
                                 o_desc, o_ptr, lse_ptr, qk_scale, q_len, num_heads, num_rows,
                                 group, out_base, seq_len, split_start, split_end, num_tiles,
                                 RIGHT, DIRECT_OUTPUT, TMA_STORE)),
            (loader_partition, (q_nope_desc, q_pe_desc, kv_nope_desc, kv_pe_desc, q_nope_smem,
                                q_pe_smem, kv_nope_smem, kv_pe_smem, q_ready, kv_ready,
                                kv_empty, bt_row, q_row, split_start, num_tiles, BLOCK_SIZE)),
        ], [4, 1], [COMPUTE_REGISTERS, LOADER_REGISTERS])
    else:  # the converter warps fill the FP8 ring and empty it into the ring above
        fp8_nope_smem = gl.allocate_shared_memory(kv_nope_desc.dtype, [FP8_STAGES, TILE, L],
                                                  kv_nope_desc.layout)
        fp8_pe_smem = gl.allocate_shared_memory(kv_pe_desc.dtype, [FP8_STAGES, TILE, R],
                                                kv_pe_desc.layout)
        fp8_ready = gl.allocate_shared_memory(gl.int64, [FP8_STAGES, 1], bar_layout)
        # Q as the products see it, once the converter has made it float16
        q_nope_view = q_nope_smem._reinterpret(gl.float16, [ROWS, L], q_nope_desc.layout)
        q_pe_view = q_pe_smem._reinterpret(gl.float16, [ROWS, R], q_pe_desc.layout)
        q_converted = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        mbarrier.init(q_converted, count=1)
        for i in gl.static_range(FP8_STAGES):
            mbarrier.init(fp8_ready.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_seesaw_partition, (q_nope_view, q_pe_view, kv_nope_smem, kv_pe_smem, stats_smem,
                                 q_converted, kv_ready, kv_empty, max_ready, p_ready, sum_ready,
                                 o_desc, o_ptr, lse_ptr, qk_scale, q_len, num_heads, num_rows,
                                 group, out_base, seq_len, split_start, split_end, num_tiles,
                                 LEFT, DIRECT_OUTPUT, TMA_STORE)),
            (_seesaw_partition, (q_nope_view, q_pe_view, kv_nope_smem, kv_pe_smem, stats_smem,
                                 q_converted, kv_ready, kv_empty, max_ready, p_ready, sum_ready,
                                 o_desc, o_ptr, lse_ptr, qk_scale, q_len, num_heads, num_rows,
                                 group, out_base, seq_len, split_start, split_end, num_tiles,
                                 RIGHT, DIRECT_OUTPUT, TMA_STORE)),
            (converter_partition, (q_nope_desc, q_pe_desc, kv_nope_desc, kv_pe_desc,
                                   q_nope_smem, q_pe_smem, fp8_nope_smem, fp8_pe_smem,
                                   kv_nope_smem, kv_pe_smem, q_ready, q_converted, fp8_ready,
                                   kv_ready, kv_empty, bt_row, q_row, split_start, num_tiles,
                                   BLOCK_SIZE)),
        ], [4, CONVERT_WARPS], [FP8_COMPUTE_REGISTERS, CONVERTER_REGISTERS])


@functools.cache
def _shared_layout(dtype: torch.dtype, rows: int, width: int) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, width], _GL_DTYPES[dtype])


def stores_by_tma(kv_lora_rank: int, block_n: int, num_stages: int, num_rows: int,
                  output_dtype: torch.dtype) -> bool:
    """Whether the pass stores its output by TMA: whole 64-row groups (q_len * H a multiple
    of 64), and a KV ring that holds the [64, L] output for staging."""
    ring_bytes = num_stages * block_n * kv_lora_rank * 2
    return num_rows % BLOCK_M == 0 and ring_bytes >= BLOCK_M * kv_lora_rank * output_dtype.itemsize


def launch_split_pass(plan: MLADecodePlan, io: SplitPassIO) -> None:
    """Stage 1 of `mla_decode_triton` where the plan names this pass (`common.gluon_serves`):
    `plan.config`'s tiles of block_n KV tokens (min_split_len a multiple of them), num_stages
    of them in the shared ring, and over an FP8 cache `plan.fp8_staging` FP8 tiles in the
    staging ring; q read by TMA, so contiguous (`SplitPassIO` has the shapes)."""
    q, kv_cache, partial_o, kv_lora_rank = io.q, io.kv_cache, io.partial_o, io.kv_lora_rank
    config, num_splits = plan.config, plan.num_splits
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    rope_dim = head_dim - kv_lora_rank
    q_rows = q.view(num_tokens * num_heads, head_dim)  # [B * q_len * H, L + R]
    kv_rows = kv_cache.view(num_blocks * block_size, head_dim)  # [num_blocks * block_size, L + R]
    descs = [TensorDescriptor.from_tensor(tensor, [rows, width],
                                          _shared_layout(tensor.dtype, rows, width))
             for tensor, rows in ((q_rows, BLOCK_M), (kv_rows, config.block_n))
             for width in (kv_lora_rank, rope_dim)]
    batch = io.block_table.shape[0]
    num_rows = io.q_len * num_heads
    out_rows = partial_o.reshape(-1)[:batch * num_splits * num_rows * kv_lora_rank].view(
        batch * num_splits * num_rows, kv_lora_rank)  # [B * num_splits * q_len * H, L]
    o_desc = TensorDescriptor.from_tensor(
        out_rows, [BLOCK_M, kv_lora_rank // 2],
        _shared_layout(partial_o.dtype, BLOCK_M, kv_lora_rank // 2))
    grid = (triton.cdiv(num_rows, BLOCK_M), num_splits, batch)
    _mla_decode_split_kernel_sm90[grid](
        *descs, io.block_table, io.seq_lens, o_desc, partial_o, io.partial_lse, io.qk_scale,
        io.q_len, num_heads, num_splits, config.min_split_len,
        io.split_len, io.block_table.stride(0),
        BLOCK_SIZE=block_size, NUM_STAGES=config.num_stages, DIRECT_OUTPUT=num_splits == 1,
        BALANCED=plan.split_slots > 0,
        TMA_STORE=stores_by_tma(kv_lora_rank, config.block_n, config.num_stages, num_rows,
                                partial_o.dtype),
        FP8_STAGES=plan.fp8_staging, num_warps=NUM_WARPS)


__all__ = ["launch_split_pass", "stores_by_tma"]
