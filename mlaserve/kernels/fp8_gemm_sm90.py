"""Block-FP8 w8a8 GEMM for sm_90 in Gluon: warp-specialised, persistent, TMA-fed wgmma.

The product of `fp8_gemm.block_fp8_matmul` (y = x W^T, x [M, K] and W [N, K] float8_e4m3fn
with 1 x 128 and 128 x 128 float32 scales; that module's docstring has the math), laid out by
hand where Triton's pipeliner cannot: a K block's product must be scaled before it joins the
accumulator, so each block is a fresh wgmma whose result is waited on at once, and a single
instruction stream leaves the tensor cores idle during that scaling. Here, as in DeepSeek's
DeepGEMM, three partitions share each CTA:

- A 1-warp loader issues TMA copies of x [128, 128] and W [BLOCK_N, 128] for every K block of
  the CTA's tiles into a ring of NUM_STAGES shared buffers guarded by ready / empty mbarriers. It
  runs ahead across tile boundaries, so the next tile's first blocks load during the epilogue.
- Two compute warpgroups take the tile's rows 0-63 and 64-127. For each K block k, one
  wgmma [64, 128] x [128, BLOCK_N] in FP8 (the hardware adds the 128 products of a column in
  its reduced-precision accumulator, as cuBLASLt does), then in float32
      acc += block * (S_x[rows, k] * S_w[n // 128, k]),
  and the buffer goes back to the loader once both warpgroups are past it. The K blocks go in
  chains of K_UNROLL: block k + 1's product is issued before block k is waited for, so block
  k's scaling runs under a product of the same warpgroup (two in flight), and the other
  warpgroup's products fill the rest. A chain starts with nothing in flight: an accumulator
  still in flight at a loop's back edge would be copied there, and ptxas then serialises every
  wgmma (its notes C7514 / C7515); the running acc passes through each wait so that the
  compiler scales each block as it lands rather than all at the chain's end, which would keep
  K_UNROLL blocks in registers.
- A tile's output [64, BLOCK_N] per warpgroup is rounded to y's dtype, written to shared memory
  and stored by TMA (which clips rows and columns past y), while the warpgroup goes on to its
  next tile; the staging buffer is reused only after that store has read it.

Tiles are 128 x BLOCK_N, BLOCK_N 128 or 64 (a divisor of the weight's 128-row scale blocks: one
weight scale per tile and K block), visited by a persistent grid of one CTA per SM in groups of
GROUP_M row tiles that share the weight tiles through L2. How a product is cut into work so
that the rounds keep the SMs busy (the width, stream-K, K split into runs) is decided in
`fp8_gemm_sm90_plan`. Stream-K tiles come first: each CTA takes an even share of their K
blocks, then whole work units (a tile, or with K split a tile's run of K blocks, whose float32
sum goes to its own slab of [splits, rows rounded up to 128, N], added in y's dtype by a
second launch).

TMA zero-fills rows, columns and K past the operands, so any M, N and K work within TMA's
alignment (K a multiple of 16, N of 8; `gluon_gemm_serves`). Needs Triton's Gluon (Triton >=
3.6) and an sm_90 GPU.
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mlaserve.kernels.fp8_blocks import FP8_DTYPE
from mlaserve.kernels.fp8_gemm import check_operands, is_sm90, sm_count, sum_splits
from mlaserve.kernels.fp8_gemm_sm90_plan import (
    BLOCK_K,
    BLOCK_M,
    BLOCK_NS,
    DEFAULT_GROUP_M,
    DEFAULT_K_UNROLL,
    DEFAULT_STAGES,
    STREAM_K,
    choose_block_n,
    choose_k_splits,
    choose_stream_k_tiles,
    gluon_gemm_serves,
    shared_memory_bytes,
)
from mlaserve.kernels.mla_decode.common import GLUON_SHARED_MEMORY_LIMIT

SCALE_ROWS = gl.constexpr(128)  # the weight's scale blocks are 128 x 128
NUM_WARPS = 4  # the default partition: the first compute warpgroup
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@gluon.jit
def _tile_origin(tile, num_tiles_m, num_tiles_n, GROUP_M: gl.constexpr,
                 TILE_M: gl.constexpr, TILE_N: gl.constexpr):
    """The first row and column of `tile` (0 .. tiles - 1): row tiles in groups of GROUP_M,
    column-major within a group, so consecutive CTAs share weight tiles."""
    tiles_per_group = GROUP_M * num_tiles_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = gl.minimum(num_tiles_m - first_m, GROUP_M)
    in_group = tile % tiles_per_group
    return (first_m + in_group % group_rows) * TILE_M, (in_group // group_rows) * TILE_N


@gluon.jit
def _stream_k_share(num_k_blocks, stream_k_tiles):
    """This CTA's even share [start, end) of the stream-K tiles' K blocks, numbered tile by
    tile (tile t's block k is t * num_k_blocks + k)."""
    total = stream_k_tiles * num_k_blocks
    return (gl.program_id(0) * total // gl.num_programs(0),
            (gl.program_id(0) + 1) * total // gl.num_programs(0))


@gluon.jit
def _next_work(block, end, unit, num_tiles_m, num_tiles_n, num_k_blocks, blocks_per_split,
               stream_k_tiles, GROUP_M: gl.constexpr, TILE_M: gl.constexpr,
               TILE_N: gl.constexpr):
    """The CTA's next work: while block < end, the stream-K segment from K block `block` of
    its share to the end of the share or of block's tile; then work unit `unit` (0 .. (tiles
    - stream_k_tiles) x splits - 1, of the tiles after the stream-K ones; consecutive units
    take neighbouring tiles of one split). Returns the tile, its first row and column, the
    split and the K blocks [first_block, end_block)."""
    if block < end:
        tile = block // num_k_blocks
        first_block = block - tile * num_k_blocks
        end_block = gl.minimum(num_k_blocks, first_block + end - block)
        split = 0
    else:
        num_tiles = num_tiles_m * num_tiles_n - stream_k_tiles
        split = unit // num_tiles
        tile = stream_k_tiles + unit % num_tiles
        first_block = split * blocks_per_split
        end_block = gl.minimum(first_block + blocks_per_split, num_k_blocks)
    off_m, off_n = _tile_origin(tile, num_tiles_m, num_tiles_n, GROUP_M, TILE_M, TILE_N)
    return tile, off_m, off_n, split, first_block, end_block


@gluon.jit
def _advance(block, end, unit, first_block, end_block):
    """Past the work `_next_work` gave: the share's next block, or the CTA's next unit."""
    if block < end:
        block += end_block - first_block
    else:
        unit += gl.num_programs(0)
    return block, unit


@gluon.jit
def _loader_partition(x_desc, w_desc, x_smem, w_smem, ready, empty, num_tiles_m, num_tiles_n,
                      num_k_blocks, blocks_per_split, stream_k_tiles, GROUP_M: gl.constexpr):
    """1 warp: the TMA copies of x [128, 128] and W [BLOCK_N, 128] of every K block of this
    CTA's stream-K segments and work units (the i-th block overall -> buffer i % NUM_STAGES)."""
    TILE_M: gl.constexpr = x_smem.type.shape[1]
    TILE_N: gl.constexpr = w_smem.type.shape[1]
    count = 0
    block, end = _stream_k_share(num_k_blocks, stream_k_tiles)
    unit = gl.program_id(0)
    num_units = ((num_tiles_m * num_tiles_n - stream_k_tiles)
                 * gl.cdiv(num_k_blocks, blocks_per_split))
    while (block < end) | (unit < num_units):
        _, off_m, off_n, _, first_block, end_block = _next_work(
            block, end, unit, num_tiles_m, num_tiles_n, num_k_blocks, blocks_per_split,
            stream_k_tiles, GROUP_M, TILE_M, TILE_N)
        count = _load_blocks(x_desc, w_desc, x_smem, w_smem, ready, empty, off_m, off_n,
                             first_block, end_block, count)
        block, unit = _advance(block, end, unit, first_block, end_block)


@gluon.jit
def _load_blocks(x_desc, w_desc, x_smem, w_smem, ready, empty, off_m, off_n, first_block,
                 end_block, count):
    """The TMA copies of K blocks [first_block, end_block) of the tile at (off_m, off_n); the
    CTA's count-th block overall goes to buffer count % NUM_STAGES. Returns the new count."""
    STAGES: gl.constexpr = x_smem.type.shape[0]
    TILE_K: gl.constexpr = x_smem.type.shape[2]
    block_bytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    for k_block in range(first_block, end_block):
        stage = count % STAGES
        # A fresh barrier counts as having completed the phase before phase 0: parity 1
        # passes.
        mbarrier.wait(empty.index(stage), ((count // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), block_bytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, k_block * TILE_K],
                                        ready.index(stage), x_smem.index(stage))
        tma.async_copy_global_to_shared(w_desc, [off_n, k_block * TILE_K],
                                        ready.index(stage), w_smem.index(stage))
        count += 1
    return count


@gluon.jit
def _issue_block(x_smem, w_smem, ready, count, zeros, HALF: gl.constexpr):
    """Wait for the CTA's count-th K block and issue this warpgroup's FP8 product of it,
    [64, 128] x [128, BLOCK_N] -> [64, BLOCK_N] float32 (async; the hardware adds each
    column's 128 products in its reduced-precision accumulator, as cuBLASLt does)."""
    STAGES: gl.constexpr = x_smem.type.shape[0]
    ROWS: gl.constexpr = x_smem.type.shape[1] // 2
    stage = count % STAGES
    mbarrier.wait(ready.index(stage), (count // STAGES) & 1)
    a = x_smem.index(stage).slice(HALF * ROWS, ROWS, dim=0)  # [64, 128]
    b = w_smem.index(stage).permute((1, 0))  # [128 (K), BLOCK_N], K-major
    return warpgroup_mma(a, b, zeros, use_acc=False, is_async=True)


@gluon.jit
def _block_scales(x_scale_row, w_scale_row, k_block, stride_xs_k, row_ok):
    """S_x[rows, k] * S_w[n // 128, k]: [64] float32, the scale of K block k's product per row
    (0 for rows past M)."""
    x_scale = gl.load(x_scale_row + k_block * stride_xs_k, mask=row_ok, other=0.0)
    return x_scale * gl.load(w_scale_row + k_block)


@gluon.jit
def _add_scaled(acc, block, scale, empty, count):
    """Give the count-th K block's buffer back to the loader (its product is done) and return
    acc + block * scale[:, None], [64, BLOCK_N] float32."""
    STAGES: gl.constexpr = empty.type.shape[0]
    mbarrier.arrive(empty.index(count % STAGES))
    return acc + block * gl.expand_dims(scale, 1)


@gluon.jit
def _accumulate(x_smem, w_smem, ready, empty, count, first_block, end_block, x_scale_row,
                w_scale_row, stride_xs_k, row_ok, HALF: gl.constexpr, K_UNROLL: gl.constexpr):
    """This warpgroup's sum over K blocks [first_block, end_block) of its 64 rows of a tile,
    the CTA's count-th block overall first: ([64, BLOCK_N] float32, the new count). K blocks
    go in groups of K_UNROLL, each group a chain: block i + 1's product is issued before block
    i is waited for and scaled, so the scaling runs under a product. A group starts with
    nothing in flight: an accumulator still in flight across a loop iteration would be copied
    at the back edge, and ptxas then serialises every wgmma."""
    TILE_N: gl.constexpr = w_smem.type.shape[1]
    ROWS: gl.constexpr = x_smem.type.shape[1] // 2
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, TILE_N, 32])
    zeros = gl.zeros([ROWS, TILE_N], gl.float32, ACC)
    acc = zeros
    num_groups = (end_block - first_block) // K_UNROLL
    for group in range(num_groups):
        first = first_block + group * K_UNROLL
        token_prev = _issue_block(x_smem, w_smem, ready, count, zeros, HALF)
        scale_prev = _block_scales(x_scale_row, w_scale_row, first, stride_xs_k, row_ok)
        for i in gl.static_range(1, K_UNROLL):
            token = _issue_block(x_smem, w_smem, ready, count + i, zeros, HALF)
            scale = _block_scales(x_scale_row, w_scale_row, first + i, stride_xs_k, row_ok)
            # acc passes through the wait: the previous block's scaling is done by then,
            # under this block's product, and not left for the end of the chain
            block, acc = warpgroup_mma_wait(1, deps=[token_prev, acc])
            acc = _add_scaled(acc, block, scale_prev, empty, count + i - 1)
            token_prev = token
            scale_prev = scale
        acc = _add_scaled(acc, warpgroup_mma_wait(0, deps=[token_prev]), scale_prev, empty,
                          count + K_UNROLL - 1)
        count += K_UNROLL
    for k_block in range(first_block + num_groups * K_UNROLL, end_block):  # one by one
        token = _issue_block(x_smem, w_smem, ready, count, zeros, HALF)
        scale = _block_scales(x_scale_row, w_scale_row, k_block, stride_xs_k, row_ok)
        acc = _add_scaled(acc, warpgroup_mma_wait(0, deps=[token]), scale, empty, count)
        count += 1
    return acc, count


@gluon.jit
def _store_rows(acc, staging, y_desc, row, column):
    """Store acc [64, BLOCK_N] at y[row:, column:] (y's dtype) by TMA through the warpgroup's
    staging buffer, once the previous store has read it."""
    tma.store_wait(0)
    gl.thread_barrier()
    staging.store(acc.to(y_desc.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(y_desc, [row, column], staging)


@gluon.jit
def _partial_offsets(tile, HALF: gl.constexpr, ROWS: gl.constexpr, TILE_N: gl.constexpr,
                     layout: gl.constexpr):
    """[64, BLOCK_N]: this warpgroup's rows of tile `tile` in partial sums [tiles, 128, N]."""
    rows = (tile * 2 + HALF) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    columns = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, layout))
    return gl.expand_dims(rows, 1) * TILE_N + gl.expand_dims(columns, 0)


@gluon.jit
def _compute_partition(x_smem, w_smem, out_smem, ready, empty, y_desc, x_scale_ptr,
                       w_scale_ptr, partial_ptr, flag_ptr, M, num_tiles_m, num_tiles_n,
                       num_k_blocks, blocks_per_split, stream_k_tiles, stride_xs_m,
                       stride_xs_k, stride_ws_n, HALF: gl.constexpr, GROUP_M: gl.constexpr,
                       K_UNROLL: gl.constexpr):
    """One compute warpgroup: rows HALF * 64 .. HALF * 64 + 63 of each of the CTA's stream-K
    segments and work units, stored at row split * (M rounded up to a tile) + the row of y
    (split 0 unless K is split).

    A stream-K tile lies in at most two CTAs' shares (each share is a tile or more deep): the
    CTA of its last K blocks, which takes them first in its share, writes their sum to the
    tile's slab of partial_ptr and raises the tile's flag (release); the CTA of its first
    blocks, last in its share, waits for the flag (acquire), adds the slab, lowers the flag
    for the next launch and stores the tile."""
    TILE_M: gl.constexpr = x_smem.type.shape[1]
    TILE_N: gl.constexpr = w_smem.type.shape[1]
    ROWS: gl.constexpr = TILE_M // 2
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, TILE_N, 32])
    ROW: gl.constexpr = gl.SliceLayout(1, ACC)
    staging = out_smem.index(HALF)  # [64, BLOCK_N] of y's dtype
    split_rows = num_tiles_m * TILE_M  # rows of a run's slab of partial sums
    count = 0
    block, end = _stream_k_share(num_k_blocks, stream_k_tiles)
    unit = gl.program_id(0)
    num_units = ((num_tiles_m * num_tiles_n - stream_k_tiles)
                 * gl.cdiv(num_k_blocks, blocks_per_split))
    while (block < end) | (unit < num_units):
        tile, off_m, off_n, split, first_block, end_block = _next_work(
            block, end, unit, num_tiles_m, num_tiles_n, num_k_blocks, blocks_per_split,
            stream_k_tiles, GROUP_M, TILE_M, TILE_N)
        rows = off_m + HALF * ROWS + gl.arange(0, ROWS, layout=ROW)
        acc, count = _accumulate(
            x_smem, w_smem, ready, empty, count, first_block, end_block,
            x_scale_ptr + rows * stride_xs_m, w_scale_ptr + (off_n // SCALE_ROWS) * stride_ws_n,
            stride_xs_k, rows < M, HALF, K_UNROLL)
        flag = flag_ptr + tile * 2 + HALF
        partial = partial_ptr + _partial_offsets(tile, HALF, ROWS, TILE_N, ACC)
        if (block < end) & (first_block > 0):  # a stream-K tile's last blocks: hand over
            gl.store(partial, acc)
            gl.thread_barrier()
            gl.atomic_xchg(flag, 1, sem="release", scope="gpu")
        else:
            if (block < end) & (end_block < num_k_blocks):  # its first: add the last ones
                while gl.atomic_add(flag, 0, sem="acquire", scope="gpu") == 0:
                    pass
                acc += gl.load(partial, cache_modifier=".cg")
                gl.atomic_xchg(flag, 0, sem="relaxed", scope="gpu")
            _store_rows(acc, staging, y_desc, split * split_rows + off_m + HALF * ROWS, off_n)
        block, unit = _advance(block, end, unit, first_block, end_block)
    tma.store_wait(0)


@gluon.jit
def _block_fp8_matmul_kernel_sm90(
    x_desc,  # x_q [M, K] float8_e4m3fn: box [128, 128]
    w_desc,  # W [N, K] float8_e4m3fn: box [BLOCK_N, 128]
    y_desc,  # y [M, N] 16-bit, or with K split the partial sums [runs * M rounded up to 128,
    # N] float32: box [64, BLOCK_N]
    x_scale_ptr,  # [M, ceil(K / 128)] float32, any strides
    w_scale_ptr,  # [ceil(N / 128), ceil(K / 128)] float32, unit column stride
    partial_ptr,  # the stream-K tiles' handed-over sums [stream_k_tiles, 128, BLOCK_N] float32
    flag_ptr,  # their flags [stream_k_tiles, 2] int32, 0 at launch (and left so)
    M, N, K,
    blocks_per_split,  # K blocks per run (all of them: K not split)
    stream_k_tiles,  # the first tiles, shared evenly by K blocks across the CTAs (0: none)
    stride_xs_m, stride_xs_k, stride_ws_n,
    NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    K_UNROLL: gl.constexpr,  # K blocks per chain of overlapped products (1: none)
):
    TILE_M: gl.constexpr = x_desc.block_type.shape[0]
    TILE_N: gl.constexpr = w_desc.block_type.shape[0]
    TILE_K: gl.constexpr = x_desc.block_type.shape[1]
    num_tiles_m = gl.cdiv(M, TILE_M)
    num_tiles_n = gl.cdiv(N, TILE_N)
    num_k_blocks = gl.cdiv(K, TILE_K)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES] + x_desc.block_type.shape,
                                       x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES] + w_desc.block_type.shape,
                                       w_desc.layout)
    out_smem = gl.allocate_shared_memory(y_desc.dtype, [2] + y_desc.block_type.shape,
                                         y_desc.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both warpgroups release a buffer
    fence_async_shared()

    TOP: gl.constexpr = 0
    BOTTOM: gl.constexpr = 1
    gl.warp_specialize([
        (_compute_partition, (x_smem, w_smem, out_smem, ready, empty, y_desc, x_scale_ptr,
                              w_scale_ptr, partial_ptr, flag_ptr, M, num_tiles_m, num_tiles_n,
                              num_k_blocks, blocks_per_split, stream_k_tiles, stride_xs_m,
                              stride_xs_k, stride_ws_n, TOP, GROUP_M, K_UNROLL)),
        (_compute_partition, (x_smem, w_smem, out_smem, ready, empty, y_desc, x_scale_ptr,
                              w_scale_ptr, partial_ptr, flag_ptr, M, num_tiles_m, num_tiles_n,
                              num_k_blocks, blocks_per_split, stream_k_tiles, stride_xs_m,
                              stride_xs_k, stride_ws_n, BOTTOM, GROUP_M, K_UNROLL)),
        (_loader_partition, (x_desc, w_desc, x_smem, w_smem, ready, empty, num_tiles_m,
                             num_tiles_n, num_k_blocks, blocks_per_split, stream_k_tiles,
                             GROUP_M)),
    ], [4, 1], [232, 40])  # the second warpgroup and the loader warp: warps, registers


@functools.cache
def operand_layouts(out_dtype: torch.dtype, block_n: int = 128
                    ) -> tuple[gl.NVMMASharedLayout, gl.NVMMASharedLayout, gl.NVMMASharedLayout]:
    """The shared layouts of the FP8 operand boxes, x [128, 128] and W [block_n, 128], and of
    the output box [64, block_n] (of y's dtype, or float32 partial sums)."""
    x_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], gl.float8e4nv)
    out = gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, block_n], _GL_DTYPES[out_dtype])
    return x_layout, w_layout, out


def _stream_k_buffers(device: torch.device, num_sms: int
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The device's hand-over buffers of stream-K tiles, made at its first stream-K product
    outside CUDA-graph capture (None inside one before that: the product then does without
    stream-K): partial sums [2 * SMs, 128, 128] float32 (a product shares fewer than two
    rounds' tiles) and their flags [2 * SMs, 2] int32, zero, which each product leaves zero.
    One stream at a time uses them, as the engine runs its layers."""
    buffers = _STREAM_K_BUFFERS.get(device)
    if buffers is None and not torch.cuda.is_current_stream_capturing():
        buffers = (torch.empty(2 * num_sms, BLOCK_M, 128, dtype=torch.float32, device=device),
                   torch.zeros(2 * num_sms, 2, dtype=torch.int32, device=device))
        _STREAM_K_BUFFERS[device] = buffers
    return buffers


_STREAM_K_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def block_fp8_matmul_sm90(x_q: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                          weight_scale_inv: torch.Tensor, out_dtype: torch.dtype, *,
                          num_stages: int = DEFAULT_STAGES,
                          group_m: int = DEFAULT_GROUP_M,
                          k_unroll: int = DEFAULT_K_UNROLL,
                          block_n: int | None = None,
                          k_splits: int | None = None,
                          stream_k: bool = STREAM_K) -> torch.Tensor:
    """y [M, N] = dequant(x_q, x_scales) @ dequant(weight, weight_scale_inv)^T, the product of
    `fp8_gemm.block_fp8_matmul`, by the warp-specialised sm_90 kernel (where
    `gluon_gemm_serves` holds).

    Args:
        x_q: [M, K] float8_e4m3fn, contiguous; x_scales [M, ceil(K / 128)] float32, any
            strides (`quantize_activations` leaves them M-major).
        weight: [N, K] float8_e4m3fn, contiguous; weight_scale_inv [ceil(N / 128),
            ceil(K / 128)] float32.
        out_dtype: bfloat16 or float16.
        num_stages: K blocks in the shared ring; group_m: row tiles per weight-sharing group;
            k_unroll: K blocks per chain of overlapped products (1: each product waited
            for before it is scaled); block_n: the tile width, 128 or 64 (default:
            `choose_block_n`); k_splits: K split into this many runs of K blocks, their
            float32 sums added by a second launch (default: `choose_k_splits`); stream_k:
            whether the last round's tiles may be shared by K blocks
            (`choose_stream_k_tiles`).
    """
    rows, cols = x_q.shape
    out_features = weight.shape[0]
    if x_q.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"x_q and weight must be {FP8_DTYPE}, not {x_q.dtype} / {weight.dtype}")
    check_operands(x_q, weight, weight_scale_inv, x_scales)
    if not gluon_gemm_serves(rows, out_features, cols):
        raise ValueError(f"the sm_90 Gluon GEMM does not take x [{rows}, {cols}] @ "
                         f"W [{out_features}, {cols}]^T: K must be a multiple of 16, N of 8")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be bfloat16 or float16, not {out_dtype}")
    if block_n is not None and block_n not in BLOCK_NS:
        raise ValueError(f"block_n must be one of {BLOCK_NS}, not {block_n}")
    if k_splits is not None and k_splits < 1:
        raise ValueError(f"k_splits must be 1 or more, not {k_splits}")
    if not is_sm90(x_q.device):
        raise ValueError(f"the Gluon GEMM runs on sm_90 GPUs only, not on {x_q.device}")
    num_sms = sm_count(x_q.device)
    if block_n is None:
        block_n = choose_block_n(rows, out_features, num_sms, stream_k)
    if k_splits is None:
        k_splits = choose_k_splits(rows, out_features, cols, block_n, num_sms)
    num_k_blocks = triton.cdiv(cols, BLOCK_K)
    blocks_per_split = triton.cdiv(num_k_blocks, k_splits)
    k_splits = triton.cdiv(num_k_blocks, blocks_per_split)  # none of them empty
    staged_dtype = out_dtype if k_splits == 1 else torch.float32
    if (num_stages < 2 or shared_memory_bytes(num_stages, staged_dtype, block_n)
            > GLUON_SHARED_MEMORY_LIMIT):
        raise ValueError(f"num_stages must be 2 or more (two K blocks in flight) and fit "
                         f"sm_90's shared memory with {staged_dtype} output tiles, not "
                         f"{num_stages}")
    if k_unroll < 1:
        raise ValueError(f"k_unroll must be 1 or more, not {k_unroll}")
    x_q, weight = x_q.contiguous(), weight.contiguous()
    weight_scale_inv = weight_scale_inv.contiguous()
    y = torch.empty(rows, out_features, dtype=out_dtype, device=x_q.device)
    num_tiles_m = triton.cdiv(rows, BLOCK_M)
    # the partial sums [splits, rows rounded up to a tile, N]: a tile's rows past M stay in
    # its own split's slab
    out = y if k_splits == 1 else torch.empty(k_splits, num_tiles_m * BLOCK_M, out_features,
                                              dtype=torch.float32, device=x_q.device)
    stream_k_tiles = choose_stream_k_tiles(rows, out_features, block_n, num_sms, k_splits,
                                           stream_k)
    buffers = _stream_k_buffers(x_q.device, num_sms)
    if buffers is None:  # in a CUDA graph's capture before any launch made them: not read
        stream_k_tiles = 0
        buffers = (torch.empty(1, device=x_q.device), torch.empty(1, dtype=torch.int32,
                                                                  device=x_q.device))
    x_layout, w_layout, out_layout = operand_layouts(staged_dtype, block_n)
    x_desc = TensorDescriptor.from_tensor(x_q, [BLOCK_M, BLOCK_K], x_layout)
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, BLOCK_K], w_layout)
    y_desc = TensorDescriptor.from_tensor(out.view(-1, out_features), [BLOCK_M // 2, block_n],
                                          out_layout)  # [splits * slab rows, or M, N]
    num_units = num_tiles_m * triton.cdiv(out_features, block_n) * k_splits
    grid = (min(num_units, num_sms),)
    _block_fp8_matmul_kernel_sm90[grid](
        x_desc, w_desc, y_desc, x_scales, weight_scale_inv, *buffers, rows, out_features,
        cols, blocks_per_split, stream_k_tiles, x_scales.stride(0), x_scales.stride(1),
        weight_scale_inv.stride(0), NUM_STAGES=num_stages, GROUP_M=group_m,
        K_UNROLL=k_unroll, num_warps=NUM_WARPS)
    if k_splits > 1:
        sum_splits(out, y)
    return y


__all__ = ["block_fp8_matmul_sm90", "operand_layouts"]
