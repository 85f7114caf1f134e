"""Split pass of the paged MLA decode over an FP8 latent cache, for 16-row programs on sm_90
(Gluon).

The same problem, split arithmetic (`splits.split_bounds`) and output layout as
`_mla_decode_split_kernel` in `triton_split.py` (the merge kernel of `merge.py` finishes the
job where there are several splits), for at most 16 query rows per program (16 heads, q_len 1)
over a float8_e4m3fn cache [c_kv | k_pe] with L = 4 x 128 and R = 64, 16-bit queries.

Why a pass of its own: both products read the same FP8 tile, the scores Q K^T reducing over
the latent and P V over the keys. Converted straight into mma.sync operand layouts (what Triton
makes of `tile.to(float16)`) the P V operand needs 4 consecutive keys per latent column, 576
bytes apart, and 8-bit data has no transposed ldmatrix: it is gathered byte by byte, and the
tile is converted twice (benchmarks/mla-decode-history.md, "FP8 caches, the generated code").
Here every tile is converted once, into a float16 tile in shared memory that both products read
with ldmatrix (transposed for P V), as the 16-bit passes read their tiles:

- Q [16, L + R] is loaded once, converted to float16 and stored in shared memory as 4 latent
  chunks [16, 128] and the rope part [16, R].
- FP8 tiles [BLOCK_N, 128] x 4 and [BLOCK_N, R] come by TMA into a ring of NUM_STAGES buffers
  (one page id per tile: pages of at least BLOCK_N tokens), NUM_STAGES - 1 tiles ahead of the
  one computed. Each of the five pieces has its own buffer and its own ready mbarrier per ring
  slot, and every expect is issued before any copy: Triton orders the accesses to one shared
  allocation (an mbarrier included) with a CTA barrier, which with one buffer and one barrier
  for the whole tile put a barrier before every copy and between the chunks' conversions.
- Per tile, all 4 warps: wait for it, convert it (16 bytes a thread a row) into the float16
  tile, rows past the split set to 0 there (a page tail may hold NaN, and P = 0 times NaN is
  NaN), then S = Q K^T (5 products of 128 or R columns), the online softmax in base 2 (scores
  past the split or after a row's last key are -inf), and O_c += P V_c for the 4 chunks
  (O [16, 512] float32 as 4 chunks, each warp 32 columns of each). The row sums are kept per
  score column and added across the warps once, at the end.
- Between the conversion and the products, the ring slot that tile t - 1 left is refilled
  with tile t + NUM_STAGES - 1 (every warp has passed tile t's first barrier, so none still
  reads that slot). Seven CTA barriers a tile in all (`mlaserve bench kernel-diag resources`): one
  before the conversion (every warp is done with the previous float16 tile), the one before
  the TMA copies (FP8 bytes read by the conversion, then written by TMA), one after them (the
  float16 tile is whole), three in the row max across the warps and one in the exchange of P.

Scores are computed in base 2 (qk_scale = softmax_scale * log2(e)); lse is returned in natural
log. Needs triton.experimental.gluon (Triton >= 3.6) and an sm_90 GPU; the plan chooses this
pass only where `common.gluon_fp8_serves` holds and the configuration asks (`gluon_fp8`).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mlaserve.kernels.mla_decode.common import GLUON_FP8_CHUNK, GLUON_FP8_ROWS, SplitPassIO
from mlaserve.kernels.mla_decode.gluon_sm90_tiles import masked_scores, rescale_and_exp
from mlaserve.kernels.mla_decode.plan import MLADecodePlan
from mlaserve.kernels.mla_decode.splits import split_bounds

ROWS = gl.constexpr(GLUON_FP8_ROWS)  # query rows per program
CHUNK = GLUON_FP8_CHUNK  # latent columns per chunk (TMA box, shared tile, accumulator)
NUM_WARPS = 4


@gluon.jit
def _issue_tile(kv_desc, pe_desc, kv8_smem, pe8_smem, ready, bt_row, split_start, j,
                BLOCK_SIZE: gl.constexpr):
    """TMA copies of tile j of the split (its 4 latent chunks and its rope part) into ring
    slot j % NUM_STAGES of their buffers, each completing its own ready barrier of the slot."""
    STAGES: gl.constexpr = pe8_smem.type.shape[0]
    TILE: gl.constexpr = pe8_smem.type.shape[1]
    C: gl.constexpr = len(kv8_smem)
    LC: gl.constexpr = kv8_smem[0].type.shape[2]
    stage = j % STAGES
    start = split_start + j * TILE
    page = gl.load(bt_row + start // BLOCK_SIZE)
    row = (page * BLOCK_SIZE + start % BLOCK_SIZE).to(gl.int32)  # cache row of the tile
    # Each piece completes a barrier of its own, every expect before any copy: the compiler
    # orders the accesses to one barrier object with a CTA barrier, which with one barrier for
    # all five would come before every copy.
    for c in gl.static_range(C):
        mbarrier.expect(ready[c].index(stage), kv_desc.block_type.nbytes)
    mbarrier.expect(ready[C].index(stage), pe_desc.block_type.nbytes)
    for c in gl.static_range(C):
        tma.async_copy_global_to_shared(kv_desc, [row, c * LC], ready[c].index(stage),
                                        kv8_smem[c].index(stage))
    tma.async_copy_global_to_shared(pe_desc, [row, C * LC], ready[C].index(stage),
                                    pe8_smem.index(stage))


@gluon.jit
def _convert(source, target, num_valid, LAYOUT: gl.constexpr, PARTIAL: gl.constexpr):
    """target [BLOCK_N, W] float16 = source [BLOCK_N, W] FP8; in a PARTIAL tile (a split's
    last, cut short) rows >= num_valid are zeroed."""
    values = source.load(LAYOUT).to(gl.float16)
    if PARTIAL:
        rows = gl.arange(0, values.shape[0], layout=gl.SliceLayout(1, LAYOUT))
        values = gl.where(gl.expand_dims(rows < num_valid, 1), values, gl.zeros_like(values))
    target.store(values)


@gluon.jit
def _tile_step(kv_desc, pe_desc, kv8_smem, pe8_smem, k_smem, k_pe_smem, q_smem, q_pe_smem,
               ready, bt_row, split_start, split_end, num_tiles, t, last_key, qk_scale,
               o_0, o_1, o_2, o_3, m_i, l_cols, BLOCK_SIZE: gl.constexpr,
               PARTIAL: gl.constexpr):
    """Tile t of the split: refill the ring, convert the tile into the float16 copy, S = Q K^T,
    the online softmax (base 2) and O_c += P V_c; returns the 4 output chunks [16, 128], the
    running max [16] and the running sums per score column [16, BLOCK_N] (added up across
    the warps once, after the last tile, instead of a cross-warp sum every tile)."""
    STAGES: gl.constexpr = pe8_smem.type.shape[0]
    TILE: gl.constexpr = pe8_smem.type.shape[1]
    C: gl.constexpr = len(k_smem)
    MMA: gl.constexpr = o_0.type.layout
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    CONVERT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # [*, 128] FP8
    CONVERT_PE: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # [*, 64]
    stage = t % STAGES
    tile_start = split_start + t * TILE
    num_valid = split_end - tile_start
    for c in gl.static_range(C + 1):
        mbarrier.wait(ready[c].index(stage), (t // STAGES) & 1)
    gl.thread_barrier()  # every warp is done with the previous float16 tile
    for c in gl.static_range(C):
        _convert(kv8_smem[c].index(stage), k_smem[c], num_valid, CONVERT, PARTIAL)
    _convert(pe8_smem.index(stage), k_pe_smem, num_valid, CONVERT_PE, PARTIAL)
    ahead = t + STAGES - 1  # into the buffer tile t - 1 left (converted last time)
    if ahead < num_tiles:
        _issue_tile(kv_desc, pe_desc, kv8_smem, pe8_smem, ready, bt_row, split_start, ahead,
                    BLOCK_SIZE)
    gl.thread_barrier()  # the float16 tile is whole

    scores = gl.zeros([o_0.shape[0], TILE], gl.float32, MMA)
    for c in gl.static_range(C):
        scores = mma_v2(q_smem.index(c).load(A_LAYOUT),
                        k_smem[c].permute((1, 0)).load(B_LAYOUT), scores)
    scores = mma_v2(q_pe_smem.load(A_LAYOUT), k_pe_smem.permute((1, 0)).load(B_LAYOUT),
                    scores)  # [16, BLOCK_N]
    scores = masked_scores(scores, tile_start, split_end, last_key, qk_scale)
    m_new = gl.maximum(m_i, gl.max(scores, axis=1))
    alpha, p = rescale_and_exp(scores, m_i, m_new)
    alpha = gl.expand_dims(alpha, 1)
    l_cols = l_cols * alpha + p
    p = gl.convert_layout(p.to(gl.float16), A_LAYOUT)
    o_0 = mma_v2(p, k_smem[0].load(B_LAYOUT), o_0 * alpha)
    o_1 = mma_v2(p, k_smem[1].load(B_LAYOUT), o_1 * alpha)
    o_2 = mma_v2(p, k_smem[2].load(B_LAYOUT), o_2 * alpha)
    o_3 = mma_v2(p, k_smem[3].load(B_LAYOUT), o_3 * alpha)
    return o_0, o_1, o_2, o_3, m_new, l_cols


@gluon.jit
def _mla_decode_split_kernel_sm90_fp8(
    q_ptr,  # [B * q_len, H, L + R] 16-bit
    kv_desc,  # FP8 cache rows [num_blocks * BLOCK_SIZE, L + R]: box [BLOCK_N, 128]
    pe_desc,  # the same rows: box [BLOCK_N, R] at column L
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    o_ptr,  # [B, num_splits, q_len * H, L]: partial or final (q dtype) output
    lse_ptr,  # [B, num_splits, q_len * H] float32
    qk_scale,  # softmax_scale * log2(e)
    q_len,
    num_heads,
    num_splits,
    min_split_len,  # a multiple of BLOCK_N
    split_len_ptr,  # [1] int32: the step's least split length (BALANCED only; else unread)
    stride_q_token,
    stride_q_head,
    stride_bt,
    BLOCK_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    DIRECT_OUTPUT: gl.constexpr,
    BALANCED: gl.constexpr,  # balanced splits (common.py)
):
    TILE: gl.constexpr = kv_desc.block_type.shape[0]
    LC: gl.constexpr = kv_desc.block_type.shape[1]
    R: gl.constexpr = pe_desc.block_type.shape[1]
    C: gl.constexpr = 4
    L: gl.constexpr = C * LC
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4],
                                                  instr_shape=[16, 8])
    ROW_S: gl.constexpr = gl.SliceLayout(1, MMA)
    COL_S: gl.constexpr = gl.SliceLayout(0, MMA)
    Q_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])

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

    # one allocation per latent chunk (rings of FP8 tiles [NUM_STAGES, BLOCK_N, 128]) and per
    # float16 chunk [BLOCK_N, 128], so that the compiler sees their writes apart and puts no
    # barrier between them
    kv8_smem = (gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, TILE, LC], kv_desc.layout),
                gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, TILE, LC], kv_desc.layout),
                gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, TILE, LC], kv_desc.layout),
                gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, TILE, LC], kv_desc.layout))
    pe8_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, TILE, R], pe_desc.layout)
    K16_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, LC], gl.float16)
    k_smem = (gl.allocate_shared_memory(gl.float16, [TILE, LC], K16_LAYOUT),
              gl.allocate_shared_memory(gl.float16, [TILE, LC], K16_LAYOUT),
              gl.allocate_shared_memory(gl.float16, [TILE, LC], K16_LAYOUT),
              gl.allocate_shared_memory(gl.float16, [TILE, LC], K16_LAYOUT))
    k_pe_smem = gl.allocate_shared_memory(
        gl.float16, [TILE, R], gl.NVMMASharedLayout.get_default_for([TILE, R], gl.float16))
    q_smem = gl.allocate_shared_memory(
        gl.float16, [C, ROWS, LC], gl.NVMMASharedLayout.get_default_for([ROWS, LC], gl.float16))
    q_pe_smem = gl.allocate_shared_memory(
        gl.float16, [ROWS, R], gl.NVMMASharedLayout.get_default_for([ROWS, R], gl.float16))
    BARRIERS: gl.constexpr = mbarrier.MBarrierLayout()
    ready = (gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], BARRIERS),  # latent chunks
             gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], BARRIERS),
             gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], BARRIERS),
             gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], BARRIERS),
             gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], BARRIERS))  # rope part
    for c in gl.static_range(C + 1):
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready[c].index(i), count=1)
    fence_async_shared()  # the barriers are initialised before TMA completes on them
    gl.thread_barrier()  # and before any warp waits on them
    for j in gl.static_range(NUM_STAGES - 1):
        if j < num_tiles:
            _issue_tile(kv_desc, pe_desc, kv8_smem, pe8_smem, ready, bt_row, split_start, j,
                        BLOCK_SIZE)

    # Q rows r = t * H + h of this request, as float16 chunks in shared memory.
    q_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, Q_LOAD))
    q_offs = gl.expand_dims((req * q_len + q_rows // num_heads).to(gl.int64) * stride_q_token
                            + (q_rows % num_heads) * stride_q_head, 1)  # [ROWS, 1]
    q_mask = gl.expand_dims(q_rows < num_rows, 1)
    for c in gl.static_range(C):
        cols = gl.expand_dims(c * LC + gl.arange(0, LC, layout=gl.SliceLayout(0, Q_LOAD)), 0)
        q_chunk = gl.load(q_ptr + q_offs + cols, mask=q_mask, other=0.0)
        q_smem.index(c).store(q_chunk.to(gl.float16))
    cols_pe = gl.expand_dims(L + gl.arange(0, R, layout=gl.SliceLayout(0, Q_LOAD)), 0)
    q_pe_smem.store(gl.load(q_ptr + q_offs + cols_pe, mask=q_mask, other=0.0).to(gl.float16))

    rows = gl.arange(0, ROWS, layout=ROW_S)
    last_key = seq_len - q_len + rows // num_heads  # token t sees keys up to its position
    o_0 = gl.zeros([ROWS, LC], gl.float32, MMA)
    o_1 = gl.zeros([ROWS, LC], gl.float32, MMA)
    o_2 = gl.zeros([ROWS, LC], gl.float32, MMA)
    o_3 = gl.zeros([ROWS, LC], gl.float32, MMA)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, ROW_S)
    l_cols = gl.zeros([ROWS, TILE], gl.float32, MMA)  # row sums, per score column
    num_whole = gl.maximum(split_end - split_start, 0) // TILE
    for t in range(num_whole):
        o_0, o_1, o_2, o_3, m_i, l_cols = _tile_step(
            kv_desc, pe_desc, kv8_smem, pe8_smem, k_smem, k_pe_smem, q_smem, q_pe_smem, ready,
            bt_row, split_start, split_end, num_tiles, t, last_key, qk_scale, o_0, o_1, o_2,
            o_3, m_i, l_cols, BLOCK_SIZE, False)
    if num_whole < num_tiles:  # the split's partial last tile
        o_0, o_1, o_2, o_3, m_i, l_cols = _tile_step(
            kv_desc, pe_desc, kv8_smem, pe8_smem, k_smem, k_pe_smem, q_smem, q_pe_smem, ready,
            bt_row, split_start, split_end, num_tiles, num_whole, last_key, qk_scale, o_0, o_1,
            o_2, o_3, m_i, l_cols, BLOCK_SIZE, True)
    for c in gl.static_range(C + 1):
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready[c].index(i))

    l_i = gl.sum(l_cols, axis=1)  # [ROWS]
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453  # natural log; -inf where no key
    base = (req.to(gl.int64) * num_splits + split) * num_rows  # first output row
    row_ok = rows < num_rows
    if not DIRECT_OUTPUT:
        row_ok = row_ok & (l_i > 0.0)  # the merge never reads an empty split's output
    out_offs = (gl.expand_dims((base + rows) * L, 1)
                + gl.expand_dims(gl.arange(0, LC, layout=COL_S), 0))  # [ROWS, LC]
    out_mask = gl.expand_dims(row_ok, 1)
    inv = gl.expand_dims(1.0 / l_safe, 1)
    out_dtype: gl.constexpr = o_ptr.dtype.element_ty
    gl.store(o_ptr + out_offs, (o_0 * inv).to(out_dtype), mask=out_mask)
    gl.store(o_ptr + out_offs + LC, (o_1 * inv).to(out_dtype), mask=out_mask)
    gl.store(o_ptr + out_offs + 2 * LC, (o_2 * inv).to(out_dtype), mask=out_mask)
    gl.store(o_ptr + out_offs + 3 * LC, (o_3 * inv).to(out_dtype), mask=out_mask)
    gl.store(lse_ptr + base + rows, lse, mask=rows < num_rows)


def kv_layouts(block_n: int, rope_dim: int) -> tuple[gl.NVMMASharedLayout, gl.NVMMASharedLayout]:
    """Shared layouts of the FP8 TMA boxes: a latent chunk [block_n, 128] and the rope part
    [block_n, R]."""
    return (gl.NVMMASharedLayout.get_default_for([block_n, CHUNK], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([block_n, rope_dim], gl.float8e4nv))


def kv_descriptors(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int
                   ) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors over an FP8 cache [num_blocks, block_size, L + R] (pages back to back)
    seen as rows [num_blocks * block_size, L + R]: boxes of a latent chunk [block_n, 128] and
    of the rope part [block_n, R] (read at column L); both FP8 passes read tiles through them."""
    num_blocks, block_size, head_dim = kv_cache.shape
    rope_dim = head_dim - kv_lora_rank
    kv_rows = kv_cache.view(num_blocks * block_size, head_dim)  # [num_blocks * block_size, L + R]
    chunk_layout, rope_layout = kv_layouts(block_n, rope_dim)
    return (TensorDescriptor.from_tensor(kv_rows, [block_n, CHUNK], chunk_layout),
            TensorDescriptor.from_tensor(kv_rows, [block_n, rope_dim], rope_layout))


def launch_split_pass(plan: MLADecodePlan, io: SplitPassIO) -> None:
    """Stage 1 of `mla_decode_triton` where the plan names this pass
    (`common.gluon_fp8_serves`): 16-bit q (the last dim contiguous) over an FP8 cache with its
    pages back to back, `plan.config`'s tiles of block_n KV tokens (min_split_len a multiple of
    them), num_stages FP8 tiles in the shared ring (`SplitPassIO` has the shapes)."""
    q, config, num_splits = io.q, plan.config, plan.num_splits
    kv_desc, pe_desc = kv_descriptors(io.kv_cache, io.kv_lora_rank, config.block_n)
    _mla_decode_split_kernel_sm90_fp8[(1, num_splits, io.block_table.shape[0])](
        q, kv_desc, pe_desc, io.block_table, io.seq_lens, io.partial_o, io.partial_lse,
        io.qk_scale, io.q_len, q.shape[1], num_splits, config.min_split_len,
        io.split_len, q.stride(0),
        q.stride(1), io.block_table.stride(0), BLOCK_SIZE=io.kv_cache.shape[1],
        NUM_STAGES=config.num_stages, DIRECT_OUTPUT=num_splits == 1,
        BALANCED=plan.split_slots > 0, num_warps=NUM_WARPS)


__all__ = ["kv_descriptors", "kv_layouts", "launch_split_pass"]
