"""Split pass of the paged MLA decode over an FP8 latent cache for 16-row programs on sm_90,
with both products transposed (Gluon).

The problem, split arithmetic (`splits.split_bounds`) and outputs of `gluon_sm90_fp8.py`: at
most 16 query rows per program (16 heads, q_len 1) over a float8_e4m3fn cache [c_kv | k_pe]
with L = 4 x 128 and R = 64, 16-bit queries, float16 products with float32 accumulation. The
products are turned around so that the 16 query rows are wgmma's N, and keys or latent
columns its 64-row M:

    S^T [64 keys, 16]  = K [64 keys, L + R] Q^T                (M: keys, reduced: columns)
    O^T [L, 16]       += V^T [L, 64 keys] P^T, V = K[:, :L]    (M: columns, reduced: keys)

wgmma needs 64 rows of M but takes N = 16, so neither product pads the 16 query rows to 64
(which would be 4x the tensor-core work), and its A operand may come from registers: each FP8
tile is converted to float16 in registers, straight into the operand layout, with no float16
copy in shared memory and no barrier between conversion and product. (The 16-row pass of
`gluon_sm90_fp8.py` converts into a shared float16 tile for mma.sync.)

The A operands. wgmma gives thread (warp w, lane 4g + q) rows 16w + g + 8h (+ 64b) and
columns k = 16s + 8j + 2q + i (h, j, i in {0, 1}). Read as is from key-major tiles, that is
2 bytes at a time for S^T and single bytes for O^T, whose rows are latent columns. Each
product may order its own axes, so each picks the order that makes a thread's bytes of a key
contiguous (16-byte loads), and the change to the operand layout a byte shuffle within the
thread (`mlaserve bench kernel-diag resources` reads the SASS; the layouts and orders are in
`gluon_sm90_fp8_operands.py`):
- S^T: column k of a chunk W wide is stored column (W / 4) q + 4s + 2j + i; Q^T is stored in
  shared memory in the same order, once.
- O^T: row m = 64b + 16w + 8h + g is latent column 128w + 16g + 2b + h: warp w reads latent
  chunk w, 16 bytes per key. Keys stay in order (P^T is written in that order); the output
  is put back in column order as it is stored.

The schedule, one program per (split, request): a compute warpgroup and a loader warp (the
compiler launches 8 warps; setmaxnreg gives them 232 and 24 registers of 128 at launch):
- A loader warp copies each KV tile [64, 4 x 128] and [64, R] by TMA into a ring of
  NUM_STAGES buffers guarded by ready / empty mbarriers (one page id per tile: pages of a
  multiple of 64 tokens).
- The compute warpgroup loads Q [16, L + R] once (float16, columns in the S^T order), then per
  tile: S^T (5 wgmma chains of 128 or R columns), scores past the split or after a row's last
  key set to -inf, the column max across the 4 warps, P^T = exp2(S^T - max) stored to shared
  memory as float16 (the B operand of O^T), O^T rescaled, and O^T += V^T P^T in 4 products of
  16 keys. Each product's operand is built while the one before runs, at most two alive (32
  registers each). A split's partial last tile zeroes its keys past the end in registers (a
  page tail may hold NaN, and P = 0 times NaN is NaN). The column sums of P are kept per
  element and added across the warps once, at the end.

Scores are computed in base 2 (qk_scale = softmax_scale * log2(e)); lse is returned in natural
log. Needs triton.experimental.gluon (Triton >= 3.6) and an sm_90 GPU; the plan chooses this
pass only where `common.gluon_fp8_transposed_serves` holds and the configuration asks
(`gluon_fp8` with `fp8_transposed`), which it does by default for FP8 caches under 16-row
programs (`tuning.GLUON_FP8_TRANSPOSED_STAGES`).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)

from mlaserve.kernels.mla_decode.common import (
    GLUON_FP8_ROWS,
    GLUON_FP8_TRANSPOSED_TILE,
    SplitPassIO,
)
from mlaserve.kernels.mla_decode.gluon_sm90_fp8 import kv_descriptors
from mlaserve.kernels.mla_decode.gluon_sm90_fp8_operands import (
    TILE,
    add_values,
    columns_for_scores,
    key_scores,
    output_in_column_order,
)
from mlaserve.kernels.mla_decode.gluon_sm90_tiles import wgmma_layout
from mlaserve.kernels.mla_decode.plan import MLADecodePlan
from mlaserve.kernels.mla_decode.splits import split_bounds

NUM_WARPS = 4  # the compute warpgroup; the loader warp comes on top
# Registers per thread at launch, for the 8 warps the compiler makes of 4 + 1: two programs fit
# an SM's 64K registers; setmaxnreg then gives the compute warpgroup 232 and the loader 24.
LAUNCH_REGISTERS = 128


@gluon.jit
def _loader_partition(kv_desc, pe_desc, kv_smem, pe_smem, kv_ready, kv_empty, bt_row,
                      split_start, num_tiles, BLOCK_SIZE: gl.constexpr):
    """1 warp: TMA copies of each tile's 4 latent chunks and rope part into ring slot
    j % NUM_STAGES, once the compute warpgroup has released it."""
    STAGES: gl.constexpr = kv_smem.type.shape[0]
    C: gl.constexpr = kv_smem.type.shape[1] // TILE
    LC: gl.constexpr = kv_smem.type.shape[2]
    tile_bytes: gl.constexpr = C * kv_desc.block_type.nbytes + pe_desc.block_type.nbytes
    for j in range(num_tiles):
        stage = j % STAGES
        start = split_start + j * TILE
        page = gl.load(bt_row + start // BLOCK_SIZE)
        row = (page * BLOCK_SIZE + start % BLOCK_SIZE).to(gl.int32)  # cache row of the tile
        # A fresh barrier counts as having completed the phase before phase 0: parity 1 passes.
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        ready = kv_ready.index(stage)
        mbarrier.expect(ready, tile_bytes)
        for c in gl.static_range(C):
            tma.async_copy_global_to_shared(kv_desc, [row, c * LC], ready,
                                            kv_smem.index(stage).slice(c * TILE, TILE))
        tma.async_copy_global_to_shared(pe_desc, [row, C * LC], ready, pe_smem.index(stage))


@gluon.jit
def _tile_step(kv_smem, pe_smem, q_smem, q_pe_smem, p_smem, kv_ready, kv_empty, t,
               split_start, split_end, last_key, qk_scale, acc, m_i, l_cols,
               PARTIAL: gl.constexpr):
    """Tile t of the split: returns O^T [512, 16], the running column max [16] and the column
    sums of P per element [64, 16]."""
    STAGES: gl.constexpr = kv_smem.type.shape[0]
    S_LAYOUT: gl.constexpr = l_cols.type.layout
    KEY_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    stage = t % STAGES
    tile_start = split_start + t * TILE
    mbarrier.wait(kv_ready.index(stage), (t // STAGES) & 1)
    scores = key_scores(kv_smem, pe_smem, q_smem, q_pe_smem, stage, S_LAYOUT)
    pos = gl.expand_dims(tile_start + gl.arange(0, TILE, layout=KEY_S), 1)  # [64, 1]
    visible = (pos < split_end) & (pos <= gl.expand_dims(last_key, 0))  # [64, 16]
    scores = gl.where(visible, scores * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # columns with no key yet
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(scores - gl.expand_dims(m_safe, 0))  # [64, 16]
    l_cols = l_cols * gl.expand_dims(alpha, 0) + p
    p_smem.store(gl.permute(p.to(gl.float16), [1, 0]))  # P^T [16, 64], keys contiguous
    fence_async_shared()
    gl.thread_barrier()  # P^T is whole before wgmma reads it
    acc = acc * gl.expand_dims(alpha, 0)
    acc = add_values(kv_smem, p_smem, stage, acc, split_end - tile_start, PARTIAL)
    mbarrier.arrive(kv_empty.index(stage))
    return acc, m_new, l_cols


@gluon.jit
def _compute_partition(q_ptr, kv_smem, pe_smem, q_smem, q_pe_smem, p_smem, kv_ready, kv_empty,
                       o_ptr, lse_ptr, qk_scale, req, q_len, num_heads, num_rows, out_base,
                       seq_len, split_start, split_end, num_tiles, stride_q_token,
                       stride_q_head, DIRECT_OUTPUT: gl.constexpr):
    """The compute warpgroup: Q into shared memory, the tiles, the output and lse."""
    C: gl.constexpr = q_smem.type.shape[0]
    ROWS: gl.constexpr = q_smem.type.shape[1]
    LC: gl.constexpr = q_smem.type.shape[2]
    R: gl.constexpr = q_pe_smem.type.shape[1]
    L: gl.constexpr = C * LC
    S_LAYOUT: gl.constexpr = wgmma_layout(ROWS)  # [64 keys or latent rows, 16 query rows]
    ROW_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    Q_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    OUT: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])

    # Q rows r = t * H + h of this request, float16, columns in S^T's order.
    q_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, Q_LOAD))
    q_offs = gl.expand_dims((req * q_len + q_rows // num_heads).to(gl.int64) * stride_q_token
                            + (q_rows % num_heads) * stride_q_head, 1)  # [ROWS, 1]
    q_mask = gl.expand_dims(q_rows < num_rows, 1)
    for c in gl.static_range(C):
        cols = gl.expand_dims(c * LC + gl.arange(0, LC, layout=gl.SliceLayout(0, Q_LOAD)), 0)
        q_chunk = gl.load(q_ptr + q_offs + cols, mask=q_mask, other=0.0).to(gl.float16)
        q_smem.index(c).store(columns_for_scores(q_chunk))
    cols_pe = gl.expand_dims(L + gl.arange(0, R, layout=gl.SliceLayout(0, Q_LOAD)), 0)
    q_pe = gl.load(q_ptr + q_offs + cols_pe, mask=q_mask, other=0.0).to(gl.float16)
    q_pe_smem.store(columns_for_scores(q_pe))
    fence_async_shared()
    gl.thread_barrier()  # Q^T is whole before wgmma reads it

    rows = gl.arange(0, ROWS, layout=ROW_S)
    last_key = seq_len - q_len + rows // num_heads  # token t sees keys up to its position
    acc = gl.zeros([L, ROWS], gl.float32, S_LAYOUT)  # O^T
    m_i = gl.full([ROWS], float("-inf"), gl.float32, ROW_S)
    l_cols = gl.zeros([TILE, ROWS], gl.float32, S_LAYOUT)
    num_whole = gl.maximum(split_end - split_start, 0) // TILE
    for t in range(num_whole):
        acc, m_i, l_cols = _tile_step(kv_smem, pe_smem, q_smem, q_pe_smem, p_smem, kv_ready,
                                      kv_empty, t, split_start, split_end, last_key, qk_scale,
                                      acc, m_i, l_cols, False)
    if num_whole < num_tiles:  # the split's partial last tile
        acc, m_i, l_cols = _tile_step(kv_smem, pe_smem, q_smem, q_pe_smem, p_smem, kv_ready,
                                      kv_empty, num_whole, split_start, split_end, last_key,
                                      qk_scale, acc, m_i, l_cols, True)

    l_i = gl.sum(l_cols, axis=0)  # [ROWS]
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453  # natural log; -inf where no key
    gl.store(lse_ptr + out_base + rows, lse, mask=rows < num_rows)
    out = acc * gl.expand_dims(1.0 / l_safe, 0)
    out = gl.convert_layout(output_in_column_order(out), OUT)  # [ROWS, L]
    rows_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT))
    out_ok = rows_o < num_rows
    if not DIRECT_OUTPUT:  # the merge never reads an empty split's output
        out_ok = out_ok & (gl.convert_layout(l_i, gl.SliceLayout(1, OUT)) > 0.0)
    offs = (gl.expand_dims((out_base + rows_o) * L, 1)
            + gl.expand_dims(gl.arange(0, L, layout=gl.SliceLayout(0, OUT)), 0))  # [ROWS, L]
    gl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(out_ok, 1))


@gluon.jit
def _mla_decode_split_kernel_sm90_fp8_transposed(
    q_ptr,  # [B * q_len, H, L + R] 16-bit
    kv_desc,  # FP8 cache rows [num_blocks * BLOCK_SIZE, L + R]: box [64, 128]
    pe_desc,  # the same rows: box [64, R] at column L
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    o_ptr,  # [B, num_splits, q_len * H, L]: partial or final (q dtype) output
    lse_ptr,  # [B, num_splits, q_len * H] float32
    qk_scale,  # softmax_scale * log2(e)
    q_len,
    num_heads,
    num_splits,
    min_split_len,  # a multiple of 64
    split_len_ptr,  # [1] int32: the step's least split length (BALANCED only; else unread)
    stride_q_token,
    stride_q_head,
    stride_bt,
    ROWS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    DIRECT_OUTPUT: gl.constexpr,
    BALANCED: gl.constexpr,  # balanced splits (common.py)
):
    LC: gl.constexpr = kv_desc.block_type.shape[1]
    R: gl.constexpr = pe_desc.block_type.shape[1]
    C: gl.constexpr = 4
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
    bt_row = block_table_ptr + req.to(gl.int64) * stride_bt
    out_base = (req.to(gl.int64) * num_splits + split) * num_rows  # first output row

    # ring slot s holds a tile's 4 latent chunks [64, 128] one after the other
    kv_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, C * TILE, LC],
                                        kv_desc.layout)
    pe_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, TILE, R], pe_desc.layout)
    q_smem = gl.allocate_shared_memory(
        gl.float16, [C, ROWS, LC], gl.NVMMASharedLayout.get_default_for([ROWS, LC], gl.float16))
    q_pe_smem = gl.allocate_shared_memory(
        gl.float16, [ROWS, R], gl.NVMMASharedLayout.get_default_for([ROWS, R], gl.float16))
    p_smem = gl.allocate_shared_memory(
        gl.float16, [ROWS, TILE], gl.NVMMASharedLayout.get_default_for([ROWS, TILE], gl.float16))
    BARRIERS: gl.constexpr = mbarrier.MBarrierLayout()
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], BARRIERS)
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], BARRIERS)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_compute_partition, (q_ptr, kv_smem, pe_smem, q_smem, q_pe_smem, p_smem, kv_ready,
                              kv_empty, o_ptr, lse_ptr, qk_scale, req, q_len, num_heads,
                              num_rows, out_base, seq_len, split_start, split_end, num_tiles,
                              stride_q_token, stride_q_head, DIRECT_OUTPUT)),
        (_loader_partition, (kv_desc, pe_desc, kv_smem, pe_smem, kv_ready, kv_empty, bt_row,
                             split_start, num_tiles, BLOCK_SIZE)),
    ], [1], [24])  # the loader warp: warps, registers


def launch_split_pass(plan: MLADecodePlan, io: SplitPassIO) -> None:
    """Stage 1 of `mla_decode_triton` where the plan names this pass (`GLUON_SM90_FP8_T`):
    16-bit q (the last dim contiguous) over an FP8 cache with its pages back to back (pages of a
    multiple of 64 tokens), min_split_len a multiple of 64, `plan.config.num_stages` FP8 tiles
    in the shared ring (`SplitPassIO` has the shapes)."""
    q, config, num_splits = io.q, plan.config, plan.num_splits
    kv_desc, pe_desc = kv_descriptors(io.kv_cache, io.kv_lora_rank, GLUON_FP8_TRANSPOSED_TILE)
    _mla_decode_split_kernel_sm90_fp8_transposed[(1, num_splits, io.block_table.shape[0])](
        q, kv_desc, pe_desc, io.block_table, io.seq_lens, io.partial_o, io.partial_lse,
        io.qk_scale, io.q_len, q.shape[1], num_splits, config.min_split_len,
        io.split_len, q.stride(0),
        q.stride(1), io.block_table.stride(0), ROWS=GLUON_FP8_ROWS,
        BLOCK_SIZE=io.kv_cache.shape[1], NUM_STAGES=config.num_stages,
        DIRECT_OUTPUT=num_splits == 1, BALANCED=plan.split_slots > 0, num_warps=NUM_WARPS,
        maxnreg=LAUNCH_REGISTERS)


__all__ = ["launch_split_pass"]
