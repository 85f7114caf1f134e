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
thread (`scripts/kernel_resources.py` reads the SASS):
- S^T: column k of a chunk W wide is stored column (W / 4) q + 4s + 2j + i
  (`_columns_for_scores`); Q^T is stored in shared memory in the same order, once.
- O^T: row m = 64b + 16w + 8h + g is latent column 128w + 16g + 2b + h
  (`_rows_for_output`): warp w reads latent chunk w, 16 bytes per key. Keys stay in order
  (P^T is written in that order); the output is put back in column order as it is stored.

The schedule, one program per (split, request), 5 warps:
- A loader warp copies each KV tile [64, 4 x 128] and [64, R] by TMA into a ring of
  NUM_STAGES buffers guarded by ready / empty mbarriers (one page id per tile: pages of a
  multiple of 64 tokens).
- The compute warpgroup loads Q [16, L + R] once (float16, columns in the S^T order), then per
  tile: S^T (5 wgmma chains of 128 or R columns), scores past the split or after a row's last
  key set to -inf, the column max across the 4 warps, P^T = exp2(S^T - max) stored to shared
  memory as float16 (the B operand of O^T), O^T rescaled, and O^T += V^T P^T in two halves of
  32 keys (64 operand registers each). A split's partial last tile zeroes its keys past the
  end in registers (a page tail may hold NaN, and P = 0 times NaN is NaN). The column sums of
  P are kept per element and added across the warps once, at the end.

FP8 products (opt-in, `MLADecodeConfig.fp8_products`; both change the numerics):
- "scores" (FP8_QUERIES): the queries are rounded to e4m3 in the prologue, a scale per row and
  per 128-column group (the rope part one group), amax / 448, with correctly rounded divisions
  (`reference.fp8_query_round_trip` gives the same values), and S^T runs on FP8 tensor cores
  with both operands in shared memory, the tile as TMA stored it (one product per group,
  scaled as the groups are added): no conversion for S^T, half the pass's.
- "all" (FP8_VALUES as well): P^T is rounded to e4m3 (times 2^8, undone at the end) and O^T
  runs on FP8 tensor cores too, its A operand the tile's bytes moved into place by byte
  permutes, 32 keys a product: no conversions at all. P's rounding puts an error of e4m3's
  order (~4%) on the output.

Scores are computed in base 2 (qk_scale = softmax_scale * log2(e)); lse is returned in natural
log. Needs triton.experimental.gluon (Triton >= 3.6) and an sm_90 GPU; the plan chooses this
pass only where `common.gluon_fp8_transposed_serves` holds and the configuration asks
(`gluon_fp8` with `fp8_transposed`).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mlaserve.kernels.mla_decode.common import GLUON_FP8_ROWS, GLUON_FP8_TRANSPOSED_TILE
from mlaserve.kernels.mla_decode.gluon_sm90_fp8 import kv_descriptors
from mlaserve.kernels.mla_decode.gluon_sm90_tiles import wgmma_layout
from mlaserve.kernels.mla_decode.splits import split_bounds

TILE = gl.constexpr(GLUON_FP8_TRANSPOSED_TILE)  # keys per tile: wgmma's M in S^T
FP8_E4M3_MAX = gl.constexpr(448.0)  # the largest float8_e4m3fn value
P_SCALE = gl.constexpr(256.0)  # P (<= 1) times 2^8 before its e4m3 rounding
NUM_WARPS = 4  # the compute warpgroup; the loader warp comes on top
# Registers per thread at launch, for the 8 warps the compiler makes of 4 + 1: two programs fit
# an SM's 64K registers; setmaxnreg then gives the compute warpgroup 232 and the loader 24.
LAUNCH_REGISTERS = 128


@gluon.constexpr_function
def fp8_wgmma_layout(columns):
    """Accumulator layout of one warpgroup's FP8 wgmma over 64 rows x `columns`: FP8's K step
    is 32; the registers are those of `wgmma_layout(columns)`."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, columns, 32])


@gluon.constexpr_function
def _scores_operand_load(width):
    """Registers of a chunk [64 keys, width] of a tile as S^T's A operand reads it: thread
    (w, 4g + q) holds keys 16w + g and 16w + g + 8, and the width / 4 stored columns from
    (width / 4) q."""
    per_thread = width // 4
    regs = [[0, 1 << i] for i in range(per_thread.bit_length() - 1)] + [[8, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=regs, lane_bases=[[0, per_thread], [0, 2 * per_thread], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, width])


@gluon.constexpr_function
def _output_operand_load(keys, k_width):
    """Registers of a tile's 4 latent chunks [4, keys, 128] as O^T's A operand reads them, for
    k_width keys a register (2: float16, 4: FP8): thread (w, 4g + q) holds chunk w, columns
    16g .. 16g + 15, and keys 8 k_width s + 4 k_width j + k_width q + i (i < k_width)."""
    regs = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]]
    regs += [[0, 1 << b, 0] for b in range(k_width.bit_length() - 1)]
    regs += [[0, 4 * k_width, 0]]
    regs += [[0, (8 * k_width) << b, 0] for b in range((keys // (8 * k_width)).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[0, k_width, 0], [0, 2 * k_width, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, keys, 128])


@gluon.jit
def _columns_for_scores(x):
    """[rows, W] in stored column order -> [rows, W] in S^T's order: logical column
    16s + 8j + 2q + i is stored column (W / 4) q + 4s + 2j + i."""
    ROWS_X: gl.constexpr = x.shape[0]
    W: gl.constexpr = x.shape[1]
    x = gl.reshape(x, [ROWS_X, 4, W // 16, 2, 2])  # [rows, q, s, j, i]
    x = gl.permute(x, [0, 2, 3, 1, 4])  # [rows, s, j, q, i]
    return gl.reshape(x, [ROWS_X, W])


@gluon.jit
def _rows_for_output(x):
    """[4 chunks, keys, 128] -> V^T [512, keys] in O^T's row order: row m = 64b + 16w + 8h + g
    is latent column 128w + 16g + 2b + h."""
    KEYS: gl.constexpr = x.shape[1]
    x = gl.reshape(x, [4, KEYS, 8, 8, 2])  # [w, key, g, b, h]
    x = gl.permute(x, [3, 0, 4, 2, 1])  # [b, w, h, g, key]
    return gl.reshape(x, [512, KEYS])


@gluon.jit
def _output_in_column_order(out):
    """O^T [512, rows] in O^T's row order -> O [rows, 512] in latent column order."""
    ROWS_O: gl.constexpr = out.shape[1]
    out = gl.reshape(out, [8, 4, 2, 8, ROWS_O])  # [b, w, h, g, row]
    out = gl.permute(out, [4, 1, 3, 0, 2])  # [row, w, g, b, h]
    return gl.reshape(out, [ROWS_O, 512])


@gluon.jit
def _store_fp8_queries(q_rows_ptr, q_mask, first_column, target, SCALE_LAYOUT: gl.constexpr):
    """Round the queries' columns first_column .. + W (W: target's width) to e4m3 with a scale
    per row, amax / 448 (1 for a row of zeros), into target [16, W]; returns the scales [16]
    in SCALE_LAYOUT. Divisions rounded correctly, so the values are those of
    `reference.fp8_query_round_trip`."""
    W: gl.constexpr = target.type.shape[1]
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    cols = gl.expand_dims(first_column + gl.arange(0, W, layout=gl.SliceLayout(0, LOAD)), 0)
    q = gl.load(q_rows_ptr + cols, mask=q_mask, other=0.0).to(gl.float32)  # [16, W]
    amax = gl.max(gl.abs(q), axis=1)
    scale = gl.where(amax > 0.0, gl.div_rn(amax, gl.full_like(amax, FP8_E4M3_MAX)), 1.0)
    target.store(gl.div_rn(q, gl.expand_dims(scale, 1)).to(gl.float8e4nv))
    return gl.convert_layout(scale, SCALE_LAYOUT)


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
def _key_operand(kv_smem, pe_smem, stage, c, A_LAYOUT: gl.constexpr):
    """Piece c of ring slot `stage` as S^T's A operand, float16: latent chunk c [64, 128], or
    for c = 4 the rope part [64, R]."""
    C: gl.constexpr = kv_smem.type.shape[1] // TILE
    if c < C:
        piece = kv_smem.index(stage).slice(c * TILE, TILE)  # [64, 128]
    else:
        piece = pe_smem.index(stage)  # [64, R]
    WIDTH: gl.constexpr = piece.type.shape[1]
    k = piece.load(_scores_operand_load(WIDTH)).to(gl.float16)
    return gl.convert_layout(_columns_for_scores(k), A_LAYOUT)


@gluon.jit
def _scores(kv_smem, pe_smem, q_smem, q_pe_smem, stage, S_LAYOUT: gl.constexpr):
    """S^T [64 keys, 16] = K Q^T of ring slot `stage` (unscaled, float32): 5 products, each
    operand converted while the previous product runs (two operands live at most)."""
    C: gl.constexpr = kv_smem.type.shape[1] // TILE
    ROWS: gl.constexpr = q_smem.type.shape[1]
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT, k_width=2)
    acc = gl.zeros([TILE, ROWS], gl.float32, S_LAYOUT)
    previous = _key_operand(kv_smem, pe_smem, stage, 0, A_LAYOUT)
    acc = warpgroup_mma(previous, q_smem.index(0).permute((1, 0)), acc, use_acc=False,
                        is_async=True)
    for c in gl.static_range(1, C + 1):
        k = _key_operand(kv_smem, pe_smem, stage, c, A_LAYOUT)
        if c < C:
            q_t = q_smem.index(c).permute((1, 0))  # [128, 16]
        else:
            q_t = q_pe_smem.permute((1, 0))  # [R, 16]
        acc = warpgroup_mma(k, q_t, acc, is_async=True)
        previous = warpgroup_mma_wait(1, deps=[previous])  # its registers are free after this
        previous = k
    acc, previous = warpgroup_mma_wait(0, deps=[acc, previous])
    return acc


@gluon.jit
def _scores_fp8_queries(kv_smem, pe_smem, q_smem, q_pe_smem, q_scales, stage,
                        S_LAYOUT: gl.constexpr):
    """S^T [64 keys, 16] of ring slot `stage` with the queries in FP8: one FP8 wgmma per
    piece (4 latent chunks and the rope part) on the tile as stored, each scaled by its
    queries' scales [16] (`q_scales`, a tuple of 5) as the pieces are added."""
    ROWS: gl.constexpr = q_smem.type.shape[1]
    S8_LAYOUT: gl.constexpr = fp8_wgmma_layout(ROWS)
    zeros = gl.zeros([TILE, ROWS], gl.float32, S8_LAYOUT)
    slot = kv_smem.index(stage)  # [4 x 64, 128]
    s_0 = warpgroup_mma(slot.slice(0, TILE), q_smem.index(0).permute((1, 0)), zeros,
                        use_acc=False, is_async=True)
    s_1 = warpgroup_mma(slot.slice(TILE, TILE), q_smem.index(1).permute((1, 0)), zeros,
                        use_acc=False, is_async=True)
    s_2 = warpgroup_mma(slot.slice(2 * TILE, TILE), q_smem.index(2).permute((1, 0)), zeros,
                        use_acc=False, is_async=True)
    s_3 = warpgroup_mma(slot.slice(3 * TILE, TILE), q_smem.index(3).permute((1, 0)), zeros,
                        use_acc=False, is_async=True)
    s_pe = warpgroup_mma(pe_smem.index(stage), q_pe_smem.permute((1, 0)), zeros, use_acc=False,
                         is_async=True)
    s_0, s_1, s_2, s_3, s_pe = warpgroup_mma_wait(0, deps=[s_0, s_1, s_2, s_3, s_pe])
    scale_0, scale_1, scale_2, scale_3, scale_pe = q_scales
    return (gl.convert_layout(s_0, S_LAYOUT) * gl.expand_dims(scale_0, 0)
            + gl.convert_layout(s_1, S_LAYOUT) * gl.expand_dims(scale_1, 0)
            + gl.convert_layout(s_2, S_LAYOUT) * gl.expand_dims(scale_2, 0)
            + gl.convert_layout(s_3, S_LAYOUT) * gl.expand_dims(scale_3, 0)
            + gl.convert_layout(s_pe, S_LAYOUT) * gl.expand_dims(scale_pe, 0))


@gluon.jit
def _value_operand(chunks, part, num_valid, A_LAYOUT: gl.constexpr, PARTIAL: gl.constexpr):
    """Keys 16 part .. 16 part + 15 of a tile's chunks [4, 64, 128] as O^T's A operand V^T
    [512, 16], float16; in a PARTIAL tile the keys >= num_valid are zeroed."""
    LOAD: gl.constexpr = _output_operand_load(16, 2)
    v = chunks.slice(part * 16, 16, dim=1).load(LOAD).to(gl.float16)  # [4, 16, 128]
    if PARTIAL:
        keys = part * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LOAD)))
        keep = gl.expand_dims(gl.expand_dims(keys < num_valid, 0), 2)  # [1, 16, 1]
        v = gl.where(keep, v, gl.zeros_like(v))
    return gl.convert_layout(_rows_for_output(v), A_LAYOUT)


@gluon.jit
def _add_values(kv_smem, p_smem, stage, acc, num_valid, PARTIAL: gl.constexpr):
    """O^T += V^T P^T over ring slot `stage`, 16 keys a product, each operand converted while
    the previous product runs (two operands live at most)."""
    C: gl.constexpr = kv_smem.type.shape[1] // TILE
    LC: gl.constexpr = kv_smem.type.shape[2]
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout,
                                                 k_width=2)
    CHUNKS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                rank=3)
    chunks = kv_smem.index(stage)._reinterpret(gl.float8e4nv, [C, TILE, LC],
                                               CHUNKS)  # [4, 64, 128]
    previous = _value_operand(chunks, 0, num_valid, A_LAYOUT, PARTIAL)
    acc = warpgroup_mma(previous, p_smem.slice(0, 16, dim=1).permute((1, 0)), acc,
                        is_async=True)
    for part in gl.static_range(1, TILE // 16):
        v = _value_operand(chunks, part, num_valid, A_LAYOUT, PARTIAL)
        p_part = p_smem.slice(part * 16, 16, dim=1).permute((1, 0))  # P^T [16 keys, 16]
        acc = warpgroup_mma(v, p_part, acc, is_async=True)
        previous = warpgroup_mma_wait(1, deps=[previous])  # its registers are free after this
        previous = v
    acc, previous = warpgroup_mma_wait(0, deps=[acc, previous])
    return acc


@gluon.jit
def _add_values_fp8(kv_smem, p_smem, stage, acc, num_valid, PARTIAL: gl.constexpr):
    """O^T += V^T P^T over ring slot `stage` on FP8 tensor cores (P^T rounded to e4m3), 32 keys
    a product; the tile's bytes reach the operand layout by byte permutes only. In a PARTIAL
    tile the keys >= num_valid are zeroed."""
    C: gl.constexpr = kv_smem.type.shape[1] // TILE
    LC: gl.constexpr = kv_smem.type.shape[2]
    PART: gl.constexpr = 32  # keys: FP8 wgmma's K step
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout,
                                                 k_width=4)
    LOAD: gl.constexpr = _output_operand_load(PART, 4)
    CHUNKS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                rank=3)
    chunks = kv_smem.index(stage)._reinterpret(gl.float8e4nv, [C, TILE, LC],
                                               CHUNKS)  # [4, 64, 128]
    for part in gl.static_range(TILE // PART):
        v = chunks.slice(part * PART, PART, dim=1).load(LOAD)  # [4, 32, 128] FP8
        if PARTIAL:
            keys = part * PART + gl.arange(0, PART, layout=gl.SliceLayout(
                0, gl.SliceLayout(2, LOAD)))
            keep = gl.expand_dims(gl.expand_dims(keys < num_valid, 0), 2)  # [1, 32, 1]
            bits = v.to(gl.uint8, bitcast=True)
            v = gl.where(keep, bits, gl.zeros_like(bits)).to(gl.float8e4nv, bitcast=True)
        v = gl.convert_layout(_rows_for_output(v), A_LAYOUT)  # V^T [512, 32]
        p_part = p_smem.slice(part * PART, PART, dim=1).permute((1, 0))  # P^T [32 keys, 16]
        acc = warpgroup_mma(v, p_part, acc, is_async=True)
        # The wait takes no 8-bit operand to keep alive: each product is waited on before the
        # next operand is built.
        acc = warpgroup_mma_wait(0, deps=[acc])
    return acc


@gluon.jit
def _tile_step(kv_smem, pe_smem, q_smem, q_pe_smem, q_scales, p_smem, kv_ready, kv_empty, t,
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
    if q_smem.type.element_ty == gl.float8e4nv:
        scores = _scores_fp8_queries(kv_smem, pe_smem, q_smem, q_pe_smem, q_scales, stage,
                                     S_LAYOUT)
    else:
        scores = _scores(kv_smem, pe_smem, q_smem, q_pe_smem, stage, S_LAYOUT)
    pos = gl.expand_dims(tile_start + gl.arange(0, TILE, layout=KEY_S), 1)  # [64, 1]
    visible = (pos < split_end) & (pos <= gl.expand_dims(last_key, 0))  # [64, 16]
    scores = gl.where(visible, scores * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # columns with no key yet
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(scores - gl.expand_dims(m_safe, 0))  # [64, 16]
    l_cols = l_cols * gl.expand_dims(alpha, 0) + p
    fp8_values: gl.constexpr = p_smem.type.element_ty == gl.float8e4nv
    if fp8_values:  # P^T [16, 64] in e4m3, times 2^8 (P <= 1): exact, undone at the end
        p_smem.store(gl.permute((p * P_SCALE).to(gl.float8e4nv), [1, 0]))
    else:
        p_smem.store(gl.permute(p.to(gl.float16), [1, 0]))  # P^T [16, 64], keys contiguous
    fence_async_shared()
    gl.thread_barrier()  # P^T is whole before wgmma reads it
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, acc.type.layout)), 0)
    if fp8_values:
        acc = _add_values_fp8(kv_smem, p_smem, stage, acc, split_end - tile_start, PARTIAL)
    else:
        acc = _add_values(kv_smem, p_smem, stage, acc, split_end - tile_start, PARTIAL)
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
    S8_LAYOUT: gl.constexpr = fp8_wgmma_layout(ROWS)  # the same registers, FP8's K step
    ROW_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    Q_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    OUT: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])

    # Q rows r = t * H + h of this request, float16, columns in S^T's order.
    q_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, Q_LOAD))
    q_offs = gl.expand_dims((req * q_len + q_rows // num_heads).to(gl.int64) * stride_q_token
                            + (q_rows % num_heads) * stride_q_head, 1)  # [ROWS, 1]
    q_mask = gl.expand_dims(q_rows < num_rows, 1)
    if q_smem.type.element_ty == gl.float8e4nv:  # FP8 queries, columns in order
        q_scales = (_store_fp8_queries(q_ptr + q_offs, q_mask, 0, q_smem.index(0), ROW_S),
                    _store_fp8_queries(q_ptr + q_offs, q_mask, LC, q_smem.index(1), ROW_S),
                    _store_fp8_queries(q_ptr + q_offs, q_mask, 2 * LC, q_smem.index(2), ROW_S),
                    _store_fp8_queries(q_ptr + q_offs, q_mask, 3 * LC, q_smem.index(3), ROW_S),
                    _store_fp8_queries(q_ptr + q_offs, q_mask, L, q_pe_smem, ROW_S))
    else:  # float16 queries, columns in S^T's order
        for c in gl.static_range(C):
            cols = gl.expand_dims(c * LC + gl.arange(0, LC, layout=gl.SliceLayout(0, Q_LOAD)),
                                  0)
            q_chunk = gl.load(q_ptr + q_offs + cols, mask=q_mask, other=0.0).to(gl.float16)
            q_smem.index(c).store(_columns_for_scores(q_chunk))
        cols_pe = gl.expand_dims(L + gl.arange(0, R, layout=gl.SliceLayout(0, Q_LOAD)), 0)
        q_pe = gl.load(q_ptr + q_offs + cols_pe, mask=q_mask, other=0.0).to(gl.float16)
        q_pe_smem.store(_columns_for_scores(q_pe))
        one = gl.full([ROWS], 1.0, gl.float32, ROW_S)
        q_scales = (one, one, one, one, one)  # unused
    fence_async_shared()
    gl.thread_barrier()  # Q^T is whole before wgmma reads it

    rows = gl.arange(0, ROWS, layout=ROW_S)
    last_key = seq_len - q_len + rows // num_heads  # token t sees keys up to its position
    fp8_values: gl.constexpr = p_smem.type.element_ty == gl.float8e4nv
    O_LAYOUT: gl.constexpr = S8_LAYOUT if fp8_values else S_LAYOUT
    acc = gl.zeros([L, ROWS], gl.float32, O_LAYOUT)  # O^T
    m_i = gl.full([ROWS], float("-inf"), gl.float32, ROW_S)
    l_cols = gl.zeros([TILE, ROWS], gl.float32, S_LAYOUT)
    num_whole = gl.maximum(split_end - split_start, 0) // TILE
    for t in range(num_whole):
        acc, m_i, l_cols = _tile_step(kv_smem, pe_smem, q_smem, q_pe_smem, q_scales, p_smem,
                                      kv_ready, kv_empty, t, split_start, split_end, last_key,
                                      qk_scale, acc, m_i, l_cols, False)
    if num_whole < num_tiles:  # the split's partial last tile
        acc, m_i, l_cols = _tile_step(kv_smem, pe_smem, q_smem, q_pe_smem, q_scales, p_smem,
                                      kv_ready, kv_empty, num_whole, split_start, split_end,
                                      last_key, qk_scale, acc, m_i, l_cols, True)

    l_i = gl.sum(l_cols, axis=0)  # [ROWS]
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453  # natural log; -inf where no key
    gl.store(lse_ptr + out_base + rows, lse, mask=rows < num_rows)
    inv = 1.0 / l_safe
    if fp8_values:
        inv = inv / P_SCALE
    out = acc * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(0, O_LAYOUT)), 0)
    out = gl.convert_layout(_output_in_column_order(out), OUT)  # [ROWS, L]
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
    stride_q_token,
    stride_q_head,
    stride_bt,
    ROWS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    DIRECT_OUTPUT: gl.constexpr,
    FP8_QUERIES: gl.constexpr,  # queries rounded to e4m3, S^T on FP8 tensor cores
    FP8_VALUES: gl.constexpr,  # P rounded to e4m3, O^T on FP8 tensor cores
):
    LC: gl.constexpr = kv_desc.block_type.shape[1]
    R: gl.constexpr = pe_desc.block_type.shape[1]
    C: gl.constexpr = 4
    split = gl.program_id(1)
    req = gl.program_id(2)
    num_rows = q_len * num_heads
    seq_len = gl.load(seq_lens_ptr + req)
    _, split_start, split_end = split_bounds(seq_len, split, num_splits, min_split_len, TILE)
    num_tiles = gl.cdiv(gl.maximum(split_end - split_start, 0), TILE)
    bt_row = block_table_ptr + req.to(gl.int64) * stride_bt
    out_base = (req.to(gl.int64) * num_splits + split) * num_rows  # first output row

    # ring slot s holds a tile's 4 latent chunks [64, 128] one after the other
    kv_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, C * TILE, LC],
                                        kv_desc.layout)
    pe_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, TILE, R], pe_desc.layout)
    q_dtype: gl.constexpr = gl.float8e4nv if FP8_QUERIES else gl.float16
    q_smem = gl.allocate_shared_memory(
        q_dtype, [C, ROWS, LC], gl.NVMMASharedLayout.get_default_for([ROWS, LC], q_dtype))
    q_pe_smem = gl.allocate_shared_memory(
        q_dtype, [ROWS, R], gl.NVMMASharedLayout.get_default_for([ROWS, R], q_dtype))
    p_dtype: gl.constexpr = gl.float8e4nv if FP8_VALUES else gl.float16
    p_smem = gl.allocate_shared_memory(
        p_dtype, [ROWS, TILE], gl.NVMMASharedLayout.get_default_for([ROWS, TILE], p_dtype))
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


def launch_split_pass(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    partial_o: torch.Tensor,
    partial_lse: torch.Tensor,
    qk_scale: float,
    kv_lora_rank: int,
    q_len: int,
    num_splits: int,
    min_split_len: int,
    num_stages: int,
    fp8_products: str = "none",
) -> None:
    """Stage 1 of `mla_decode_triton` where the plan names this pass (`GLUON_SM90_FP8_T`).

    Args:
        q: [B * q_len, H, L + R] 16-bit, the last dim contiguous; kv_cache [num_blocks,
            block_size, L + R] float8_e4m3fn with its pages back to back (block_size a
            multiple of 64); block_table [B, max_blocks] int32; seq_lens [B] int32.
        partial_o, partial_lse: [B, num_splits, q_len * H, L] and [B, num_splits, q_len * H]
            (flat): the partials, or with num_splits == 1 the final o (q's dtype) and lse.
        qk_scale: softmax_scale * log2(e). kv_lora_rank: L. min_split_len: a multiple of 64;
            num_stages: FP8 tiles in the shared ring. fp8_products: which products run on
            FP8 tensor cores (`plan.FP8_PRODUCTS`): "none"; "scores" (q rounded to e4m3 as
            `reference.fp8_query_round_trip` rounds it); "all" (P rounded to e4m3 too).
    """
    num_heads = q.shape[1]
    block_size = kv_cache.shape[1]
    batch = block_table.shape[0]
    kv_desc, pe_desc = kv_descriptors(kv_cache, kv_lora_rank, GLUON_FP8_TRANSPOSED_TILE)
    _mla_decode_split_kernel_sm90_fp8_transposed[(1, num_splits, batch)](
        q, kv_desc, pe_desc, block_table, seq_lens, partial_o, partial_lse, qk_scale, q_len,
        num_heads, num_splits, min_split_len, q.stride(0), q.stride(1), block_table.stride(0),
        ROWS=GLUON_FP8_ROWS, BLOCK_SIZE=block_size, NUM_STAGES=num_stages,
        DIRECT_OUTPUT=num_splits == 1, FP8_QUERIES=fp8_products != "none",
        FP8_VALUES=fp8_products == "all", num_warps=NUM_WARPS,
        maxnreg=LAUNCH_REGISTERS)


__all__ = ["launch_split_pass"]
