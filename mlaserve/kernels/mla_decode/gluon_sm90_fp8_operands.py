"""Building blocks of the transposed FP8 decode pass (`gluon_sm90_fp8_transposed.py`, whose
docstring has the design): the register layouts in which a thread's bytes of a key are
contiguous, the axis orders that turn them into wgmma's A operands, and the two products of
one tile, S^T = K Q^T and O^T += V^T P^T. Shapes: a ring slot [4 x 64 keys, 128] plus its
rope part [64, R], Q^T chunks [16, 128] / [16, R] in shared memory, S^T [64 keys, 16], O^T
[512, 16]."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from mlaserve.kernels.mla_decode.common import GLUON_FP8_TRANSPOSED_TILE

TILE = gl.constexpr(GLUON_FP8_TRANSPOSED_TILE)  # keys per tile: wgmma's M in S^T


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
def _output_operand_load(keys):
    """Registers of a tile's 4 latent chunks [4, keys, 128] as O^T's A operand reads them:
    thread (w, 4g + q) holds chunk w, columns 16g .. 16g + 15, and keys 16s + 8j + 2q + i."""
    regs = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0]]
    regs += [[0, 16 << b, 0] for b in range((keys // 16).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=regs, lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, keys, 128])


@gluon.jit
def columns_for_scores(x):
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
def output_in_column_order(out):
    """O^T [512, rows] in O^T's row order -> O [rows, 512] in latent column order."""
    ROWS_O: gl.constexpr = out.shape[1]
    out = gl.reshape(out, [8, 4, 2, 8, ROWS_O])  # [b, w, h, g, row]
    out = gl.permute(out, [4, 1, 3, 0, 2])  # [row, w, g, b, h]
    return gl.reshape(out, [ROWS_O, 512])


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
    return gl.convert_layout(columns_for_scores(k), A_LAYOUT)


@gluon.jit
def key_scores(kv_smem, pe_smem, q_smem, q_pe_smem, stage, S_LAYOUT: gl.constexpr):
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
def _value_operand(chunks, part, num_valid, A_LAYOUT: gl.constexpr, PARTIAL: gl.constexpr):
    """Keys 16 part .. 16 part + 15 of a tile's chunks [4, 64, 128] as O^T's A operand V^T
    [512, 16], float16; in a PARTIAL tile the keys >= num_valid are zeroed."""
    LOAD: gl.constexpr = _output_operand_load(16)
    v = chunks.slice(part * 16, 16, dim=1).load(LOAD).to(gl.float16)  # [4, 16, 128]
    if PARTIAL:
        keys = part * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LOAD)))
        keep = gl.expand_dims(gl.expand_dims(keys < num_valid, 0), 2)  # [1, 16, 1]
        v = gl.where(keep, v, gl.zeros_like(v))
    return gl.convert_layout(_rows_for_output(v), A_LAYOUT)


@gluon.jit
def add_values(kv_smem, p_smem, stage, acc, num_valid, PARTIAL: gl.constexpr):
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
