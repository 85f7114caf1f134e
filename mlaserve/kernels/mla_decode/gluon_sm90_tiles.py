"""Gluon building blocks of the seesaw split pass (`gluon_sm90.py`, whose docstring has
the schedule): the TMA loader partition, the FP8 converter partition, the S product, masking,
the online-softmax step, the zeroing of a partial last tile, the P tiles shared through the
rope buffers, and the output store by TMA. Shapes: Q [64, L] / [64, R], KV tiles [BLOCK_N, L]
/ [BLOCK_N, R], S and P [64, BLOCK_N], one warpgroup's O [64, L / 2]."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)


@gluon.jit
def _copy_q(q_nope_desc, q_pe_desc, q_nope_smem, q_pe_smem, q_ready, q_row):
    """TMA copies of the program's Q rows [64, L] and [64, R], completing q_ready."""
    L: gl.constexpr = q_nope_desc.block_type.shape[1]
    mbarrier.expect(q_ready, q_nope_desc.block_type.nbytes + q_pe_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_nope_desc, [q_row, 0], q_ready, q_nope_smem)
    tma.async_copy_global_to_shared(q_pe_desc, [q_row, L], q_ready, q_pe_smem)


@gluon.jit
def _copy_tile(kv_nope_desc, kv_pe_desc, kv_nope_smem, kv_pe_smem, kv_ready, bt_row,
               split_start, j, BLOCK_SIZE: gl.constexpr):
    """TMA copies of the split's KV tile j [BLOCK_N, L] / [BLOCK_N, R] (inside one page) into
    buffer j % STAGES of the ring, completing its ready barrier."""
    STAGES: gl.constexpr = kv_nope_smem.type.shape[0]
    TILE: gl.constexpr = kv_nope_smem.type.shape[1]
    L: gl.constexpr = kv_nope_smem.type.shape[2]
    tile_bytes: gl.constexpr = kv_nope_desc.block_type.nbytes + kv_pe_desc.block_type.nbytes
    stage = j % STAGES
    start = split_start + j * TILE
    page = gl.load(bt_row + start // BLOCK_SIZE)
    cache_row = page * BLOCK_SIZE + start % BLOCK_SIZE
    ready = kv_ready.index(stage)
    mbarrier.expect(ready, tile_bytes)
    tma.async_copy_global_to_shared(kv_nope_desc, [cache_row, 0], ready, kv_nope_smem.index(stage))
    tma.async_copy_global_to_shared(kv_pe_desc, [cache_row, L], ready, kv_pe_smem.index(stage))


@gluon.jit
def loader_partition(q_nope_desc, q_pe_desc, kv_nope_desc, kv_pe_desc, q_nope_smem, q_pe_smem,
                     kv_nope_smem, kv_pe_smem, q_ready, kv_ready, kv_empty, bt_row, q_row,
                     split_start, num_tiles, BLOCK_SIZE: gl.constexpr):
    """1 warp: TMA copies of Q once and of each KV tile into the ring (tile j -> buffer j % S)."""
    STAGES: gl.constexpr = kv_nope_smem.type.shape[0]
    _copy_q(q_nope_desc, q_pe_desc, q_nope_smem, q_pe_smem, q_ready, q_row)
    for j in range(num_tiles):
        # A fresh barrier counts as having completed the phase before phase 0: parity 1 passes.
        mbarrier.wait(kv_empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
        _copy_tile(kv_nope_desc, kv_pe_desc, kv_nope_smem, kv_pe_smem, kv_ready, bt_row,
                   split_start, j, BLOCK_SIZE)


CONVERT_WARPS = gl.constexpr(4)


@gluon.jit
def _to_float16(source, target, COLUMNS: gl.constexpr, layout: gl.constexpr):
    """target [ROWS, W] float16 = source [ROWS, W] (FP8 or 16-bit) in shared memory, in
    [16, COLUMNS] pieces read in `layout` (each thread writes the elements it read, so target
    may be source's memory)."""
    ROWS: gl.constexpr = source.type.shape[0]
    WIDTH: gl.constexpr = source.type.shape[1]
    for r in gl.static_range(ROWS // 16):
        for c in gl.static_range(WIDTH // COLUMNS):
            piece = source.slice(r * 16, 16, dim=0).slice(c * COLUMNS, COLUMNS, dim=1)
            values = piece.load(layout).to(gl.float16)
            target.slice(r * 16, 16, dim=0).slice(c * COLUMNS, COLUMNS, dim=1).store(values)


@gluon.jit
def _q_to_float16(q_smem):
    """Q [64, W] 16-bit in shared memory, made float16 in place, [16, W] rows at a time."""
    WIDTH: gl.constexpr = q_smem.type.shape[1]
    PIECE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [CONVERT_WARPS, 1], [1, 0])
    as_float16 = q_smem._reinterpret(gl.float16, q_smem.type.shape, q_smem.type.layout)
    _to_float16(q_smem, as_float16, min(128, WIDTH), PIECE)


@gluon.jit
def converter_partition(q_nope_desc, q_pe_desc, kv_nope_desc, kv_pe_desc, q_nope_smem,
                        q_pe_smem, fp8_nope_smem, fp8_pe_smem, kv_nope_smem, kv_pe_smem, q_ready,
                        q_converted, fp8_ready, kv_ready, kv_empty, bt_row, q_row, split_start,
                        num_tiles, BLOCK_SIZE: gl.constexpr):
    """4 warps, over an FP8 cache, in place of the loader warp. TMA copies of Q and of the
    first FP8_STAGES FP8 tiles; Q (a bfloat16 q) made float16 in place, then q_converted says
    so; then each FP8 tile [BLOCK_N, L] / [BLOCK_N, R] of the staging ring (tile j in buffer
    j % FP8_STAGES) is converted to float16 into the ring the compute warpgroups read (buffer
    j % STAGES), [16, 128] pieces at a time (16 FP8 bytes a thread, one instruction per two
    values: bfloat16 would take two more per two values, float16 to bfloat16), and its
    buffer refilled with tile j + FP8_STAGES. e4m3 values convert exactly; NaN stays NaN (the
    compute side zeroes a partial last tile's rows as over a 16-bit cache)."""
    FP8_STAGES: gl.constexpr = fp8_nope_smem.type.shape[0]
    STAGES: gl.constexpr = kv_nope_smem.type.shape[0]
    R: gl.constexpr = kv_pe_smem.type.shape[2]
    PIECE: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [CONVERT_WARPS, 1], [1, 0])
    ROPE: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // R, R // 16], [CONVERT_WARPS, 1],
                                          [1, 0])
    _copy_q(q_nope_desc, q_pe_desc, q_nope_smem, q_pe_smem, q_ready, q_row)
    for j in gl.static_range(FP8_STAGES):
        if j < num_tiles:
            _copy_tile(kv_nope_desc, kv_pe_desc, fp8_nope_smem, fp8_pe_smem, fp8_ready, bt_row,
                       split_start, j, BLOCK_SIZE)
    mbarrier.wait(q_ready, 0)
    if q_nope_smem.type.element_ty != gl.float16:
        _q_to_float16(q_nope_smem)
        _q_to_float16(q_pe_smem)
        fence_async_shared()
        gl.thread_barrier()
    mbarrier.arrive(q_converted)
    for j in range(num_tiles):
        fp8_stage = j % FP8_STAGES
        stage = j % STAGES
        mbarrier.wait(fp8_ready.index(fp8_stage), (j // FP8_STAGES) & 1)
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        _to_float16(fp8_nope_smem.index(fp8_stage), kv_nope_smem.index(stage), 128, PIECE)
        kv_pe_smem.index(stage).store(fp8_pe_smem.index(fp8_stage).load(ROPE).to(gl.float16))
        fence_async_shared()  # the copies reach the products' (async) proxy, and the reads
        gl.thread_barrier()   # of the FP8 buffer come before its refill
        mbarrier.arrive(kv_ready.index(stage))
        if j + FP8_STAGES < num_tiles:
            _copy_tile(kv_nope_desc, kv_pe_desc, fp8_nope_smem, fp8_pe_smem, fp8_ready, bt_row,
                       split_start, j + FP8_STAGES, BLOCK_SIZE)


@gluon.jit
def issue_scores(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, kv_ready, j,
                 S_LAYOUT: gl.constexpr):
    """Wait for tile j and issue S = Q_nope K_nope^T + Q_pe K_pe^T [64, BLOCK_N] (async)."""
    STAGES: gl.constexpr = kv_nope_smem.type.shape[0]
    TILE: gl.constexpr = kv_nope_smem.type.shape[1]
    ROWS: gl.constexpr = q_nope_smem.type.shape[0]
    stage = j % STAGES
    mbarrier.wait(kv_ready.index(stage), (j // STAGES) & 1)
    zeros = gl.zeros([ROWS, TILE], gl.float32, S_LAYOUT)
    token = warpgroup_mma(q_nope_smem, kv_nope_smem.index(stage).permute((1, 0)), zeros,
                          use_acc=False, is_async=True)
    return warpgroup_mma(q_pe_smem, kv_pe_smem.index(stage).permute((1, 0)), token,
                         is_async=True)


@gluon.constexpr_function
def wgmma_layout(columns):
    """Accumulator layout of one warpgroup over 64 rows x `columns` (<= 256)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, columns, 16])


@gluon.constexpr_function
def _nvmma_layout(rows, columns, dtype):
    return gl.NVMMASharedLayout.get_default_for([rows, columns], dtype)


@gluon.jit
def masked_scores(scores, tile_start, split_end, last_key, qk_scale):
    """Scores [rows, BLOCK_N] times qk_scale, -inf past the split or after the row's last key
    (any distributed layout; also the FP8 pass's 16 rows)."""
    TILE: gl.constexpr = scores.type.shape[1]
    pos = tile_start + gl.arange(0, TILE, layout=gl.SliceLayout(0, scores.type.layout))
    visible = (gl.expand_dims(pos < split_end, 0)
               & (gl.expand_dims(pos, 0) <= gl.expand_dims(last_key, 1)))  # [64, BLOCK_N]
    return gl.where(visible, scores * qk_scale, float("-inf"))


@gluon.jit
def _zero_half_past(kv_nope_smem, stage, num_valid, HALF: gl.constexpr):
    """Zero rows >= num_valid of the warpgroup's L/2 columns of buffer `stage` (NaN in page
    tails must not meet P = 0 in the P V product), 64 columns at a time."""
    TILE: gl.constexpr = kv_nope_smem.type.shape[1]
    COLS: gl.constexpr = kv_nope_smem.type.shape[2] // 2
    CHUNK: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.expand_dims(gl.arange(0, TILE, layout=gl.SliceLayout(1, CHUNK)), 1)
    tile = kv_nope_smem.index(stage)
    for c in gl.static_range(COLS // 64):
        piece = tile.slice(HALF * COLS + c * 64, 64, dim=1)  # [BLOCK_N, 64]
        values = piece.load(CHUNK)
        piece.store(gl.where(rows < num_valid, values, gl.zeros_like(values)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def zero_tail(kv_nope_smem, kv_ready, num_tiles, split_start, split_end, HALF: gl.constexpr):
    """Wait for the split's last tile, and zero this warpgroup's half of its rows past the
    split if it is partial. Done before any product touches the tile: S only masks those rows,
    and each warpgroup's P V product reads only its own half."""
    TILE: gl.constexpr = kv_nope_smem.type.shape[1]
    STAGES: gl.constexpr = kv_nope_smem.type.shape[0]
    last = num_tiles - 1
    num_valid = split_end - (split_start + last * TILE)
    if num_valid < TILE:
        mbarrier.wait(kv_ready.index(last % STAGES), (last // STAGES) & 1)
        _zero_half_past(kv_nope_smem, last % STAGES, num_valid, HALF)


@gluon.jit
def shared_p(kv_pe_smem, stage, ROWS: gl.constexpr):
    """Tile `stage`'s rope buffer [BLOCK_N, R] seen as P [64, BLOCK_N] (same bytes)."""
    TILE: gl.constexpr = kv_pe_smem.type.shape[1]
    dtype: gl.constexpr = kv_pe_smem.type.element_ty
    return kv_pe_smem.index(stage)._reinterpret(dtype, [ROWS, TILE],
                                                _nvmma_layout(ROWS, TILE, dtype))


@gluon.jit
def rescale_and_exp(scores, m_i, m_own):
    """Online softmax (base 2) of one tile's masked scores [rows, BLOCK_N] in the frame m_own
    [rows] (the new running max): the rescale alpha = exp2(m_i - m_own) [rows] and P =
    exp2(S - m_own) [rows, BLOCK_N]. Rows that have seen no key keep m = -inf; 0 is
    subtracted there instead (no inf - inf)."""
    m_safe = gl.where(m_own == float("-inf"), 0.0, m_own)
    alpha = gl.exp2(m_i - m_safe)
    return alpha, gl.exp2(scores - gl.expand_dims(m_safe, 1))


@gluon.jit
def exp_scores(scores, m_i, m_own, l_i):
    """`rescale_and_exp` and the updated row sum l_i = l_i alpha + sum(P) [rows]."""
    alpha, p = rescale_and_exp(scores, m_i, m_own)
    return alpha, p, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def store_half_by_tma(out, o_desc, kv_nope_smem, first_row, HALF: gl.constexpr):
    """Store this warpgroup's output columns [64, L/2] (o_desc's box) by TMA, staged in the
    KV ring, which no product reads any more (both warpgroups have passed their last tile):
    stored from the wgmma layout, whose threads hold two adjacent columns each, 64 rows
    would take 16-byte pieces per row and cost several µs per program."""
    ROWS: gl.constexpr = o_desc.block_type.shape[0]
    COLS: gl.constexpr = o_desc.block_type.shape[1]
    staging = kv_nope_smem._reinterpret(o_desc.dtype, [2, ROWS, COLS], o_desc.layout)
    half = staging.index(HALF)  # [64, L/2]
    half.store(out.to(o_desc.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(o_desc, [first_row, HALF * COLS], half)
    tma.store_wait(0)
