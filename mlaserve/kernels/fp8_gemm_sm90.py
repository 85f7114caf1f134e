"""Block-FP8 w8a8 GEMM for sm_90 in Gluon: warp-specialised, persistent, TMA-fed wgmma.

The product of `fp8_gemm.block_fp8_matmul` (y = x W^T, x [M, K] and W [N, K] float8_e4m3fn
with 1 x 128 and 128 x 128 float32 scales; that module's docstring has the math), laid out by
hand where Triton's pipeliner cannot: a K block's product must be scaled before it joins the
accumulator, so each block is a fresh wgmma whose result is waited on at once, and a single
instruction stream leaves the tensor cores idle during that scaling. Here, as in DeepSeek's
DeepGEMM, three partitions share each CTA:

- A 1-warp loader issues TMA copies of x [128, 128], W [BLOCK_N, 128] and x's scales of the
  block (S_x[rows, k], 128 floats, from the scales' M-major layout) for every K block of the
  CTA's tiles into a ring of NUM_STAGES shared buffers guarded by ready / empty mbarriers. It
  runs ahead across tile boundaries, so the next tile's first blocks load during the epilogue.
  The compute warpgroups read the scales from shared memory: loaded from global memory under
  the products instead, their latency stalled the warpgroups: the kernel took 1.06-1.24x
  this one's time on V3's products at 1024-4096 tokens (benchmarks/fp8/README.md).
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
GROUP_M row tiles that share the weight tiles through L2. The CTAs finish after as many rounds
("waves") as the busiest one has tiles, so a shape with a few more 128-wide tiles than SMs
takes two rounds for little more than one's work: V3's fused q_a + kv_a product (N = 2112) at
1024 tokens is 136 tiles on 132 SMs. `choose_block_n` takes 64-wide tiles, half the work each,
where that shortens the rounds enough to pay for their smaller products (264 tiles: two rounds,
each 0.8 of a wide round's time on the H200).

A product of few tiles leaves most SMs idle however the tiles are cut: V3's q_a + kv_a at 64
tokens is 33 narrow tiles on 132 SMs, each 56 K blocks deep. There K is split
(`choose_k_splits`): the grid's work units are (tile, run of K blocks), each unit's float32 sum
goes to its own slab of a partial buffer [splits, rows rounded up to 128, N] (the rounding keeps
a tile's rows past M inside its own slab), and a second launch adds the slabs in y's dtype.

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

from mlaserve.kernels.fp8_blocks import FP8_DTYPE, scales_column_stride
from mlaserve.kernels.fp8_gemm_common import check_operands, is_sm90, sm_count, sum_splits
from mlaserve.kernels.mla_decode.common import GLUON_SHARED_MEMORY_LIMIT

BLOCK_M = 128  # two warpgroups of 64 rows
BLOCK_NS = (128, 64)  # within one weight scale row per tile
BLOCK_K = 128  # one scale column per K block
SCALE_ROWS = gl.constexpr(128)  # the weight's scale blocks are 128 x 128
# The time of a round of 64-wide tiles against a round of 128-wide ones, measured on the H200
# (`mlaserve bench gemm-tune gluon`, both widths on V3's shapes: 0.73-0.83, not 0.5): a 64-wide
# wgmma reads as many x bytes as a 128-wide one for half the work, and a tile has fixed costs
NARROW_ROUND_COST = 0.8
# K is split only where the tiles fill at most half the SMs, and into runs of at least this many
# K blocks (a unit's fixed costs, and the partial sums' traffic, against its products)
MIN_SPLIT_BLOCKS = 4
NUM_WARPS = 4  # the default partition: the first compute warpgroup
DEFAULT_STAGES = 5  # 5 x 32.5 KB ring (tiles, x's scales) + 32 KB output staging: 1 CTA/SM
DEFAULT_GROUP_M = 8
DEFAULT_K_UNROLL = 2  # chains of 2 beat 4 on 11 of V3's 14 cells (benchmarks/fp8/gemm_sm90.log)
# x's scales of one K block, a box [1, 128] of the scales seen K-major ([G, M], M contiguous)
SCALE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def shared_memory_bytes(num_stages: int, out_dtype: torch.dtype, block_n: int = 128) -> int:
    """The shared memory a CTA takes (an upper bound): the ring of FP8 x and W tiles with x's
    float32 scales, the output staging [2, 64, block_n], and 512 bytes for the barriers and
    the buffers' alignment (272 used by 5 stages: a float32-staged ring of 5 stages, as a split
    K uses, then just fits)."""
    ring = num_stages * ((BLOCK_M + block_n) * BLOCK_K + BLOCK_M * 4)
    return ring + BLOCK_M * block_n * out_dtype.itemsize + 512


def choose_block_n(rows: int, out_features: int, num_sms: int) -> int:
    """128, or 64 where 128-wide tiles leave the last round of the persistent grid mostly
    empty: a width's estimated time is its rounds (ceil(tiles / SMs)) times the time of one
    of its rounds (1 at 128, NARROW_ROUND_COST at 64)."""
    def rounds(block_n: int) -> int:
        tiles = -(-rows // BLOCK_M) * -(-out_features // block_n)
        return -(-tiles // num_sms)

    return 64 if rounds(64) * NARROW_ROUND_COST < rounds(128) else 128


def choose_k_splits(rows: int, out_features: int, in_features: int, block_n: int,
                    num_sms: int) -> int:
    """Into how many runs of K blocks the product is split: 1 where its tiles (128 x block_n)
    fill more than half the SMs, else as many as fill the SMs with one unit each, at most one
    per `MIN_SPLIT_BLOCKS` K blocks (V3's q_a + kv_a, K = 7168, narrow tiles: 4 at 64 tokens,
    2 at 256)."""
    tiles = -(-rows // BLOCK_M) * -(-out_features // block_n)
    if 2 * tiles > num_sms:
        return 1
    return max(1, min(num_sms // tiles, -(-in_features // BLOCK_K) // MIN_SPLIT_BLOCKS))


def gluon_gemm_serves(rows: int, out_features: int, in_features: int) -> bool:
    """Whether `block_fp8_matmul_sm90` takes x [rows, K] @ W [N, K]^T on an sm_90 GPU: TMA's
    16-byte rows (K a multiple of 16, N of 8 for a 16-bit y) and at least one row."""
    return rows > 0 and in_features > 0 and in_features % 16 == 0 and out_features % 8 == 0


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
def _unit_work(unit, num_tiles_m, num_tiles_n, num_k_blocks, blocks_per_split,
               GROUP_M: gl.constexpr, TILE_M: gl.constexpr, TILE_N: gl.constexpr):
    """Work unit `unit` (0 .. tiles x splits - 1): its tile's first row and column, its split
    and its K blocks [first_block, end_block). Consecutive units take neighbouring tiles of
    one split."""
    num_tiles = num_tiles_m * num_tiles_n
    split = unit // num_tiles
    off_m, off_n = _tile_origin(unit % num_tiles, num_tiles_m, num_tiles_n, GROUP_M, TILE_M,
                                TILE_N)
    first_block = split * blocks_per_split
    end_block = gl.minimum(first_block + blocks_per_split, num_k_blocks)
    return off_m, off_n, split, first_block, end_block


@gluon.jit
def _loader_partition(x_desc, w_desc, scale_desc, x_smem, w_smem, scale_smem, ready, empty,
                      num_tiles_m, num_tiles_n, num_k_blocks, blocks_per_split,
                      GROUP_M: gl.constexpr):
    """1 warp: the TMA copies of x [128, 128], W [BLOCK_N, 128] and x's scales [1, 128] of every
    K block of this CTA's work units (the i-th block overall -> buffer i % NUM_STAGES)."""
    STAGES: gl.constexpr = x_smem.type.shape[0]
    TILE_M: gl.constexpr = x_smem.type.shape[1]
    TILE_N: gl.constexpr = w_smem.type.shape[1]
    TILE_K: gl.constexpr = x_smem.type.shape[2]
    block_bytes: gl.constexpr = (x_desc.block_type.nbytes + w_desc.block_type.nbytes
                                 + scale_desc.block_type.nbytes)
    count = 0
    num_units = num_tiles_m * num_tiles_n * gl.cdiv(num_k_blocks, blocks_per_split)
    for unit in range(gl.program_id(0), num_units, gl.num_programs(0)):
        off_m, off_n, split, first_block, end_block = _unit_work(
            unit, num_tiles_m, num_tiles_n, num_k_blocks, blocks_per_split, GROUP_M, TILE_M,
            TILE_N)
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
            tma.async_copy_global_to_shared(scale_desc, [k_block, off_m],
                                            ready.index(stage), scale_smem.index(stage))
            count += 1


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
def _block_scales(scale_smem, w_scale_row, count, k_block, HALF: gl.constexpr,
                  ROW: gl.constexpr):
    """S_x[rows, k] * S_w[n // 128, k]: [64] float32 in layout ROW, the scale of the CTA's
    count-th K block (K block k of the tile) per row of this warpgroup (0 for rows past M:
    TMA zero-fills them). Its buffer must have landed (`_issue_block` waited for it)."""
    STAGES: gl.constexpr = scale_smem.type.shape[0]
    ROWS: gl.constexpr = scale_smem.type.shape[2] // 2
    x_scale = scale_smem.index(count % STAGES).reshape([2 * ROWS]).slice(
        HALF * ROWS, ROWS).load(ROW)  # [1, 128] -> [128] -> this warpgroup's [64]
    return x_scale * gl.load(w_scale_row + k_block)


@gluon.jit
def _add_scaled(acc, block, scale, empty, count):
    """Give the count-th K block's buffer back to the loader (its product is done) and return
    acc + block * scale[:, None], [64, BLOCK_N] float32."""
    STAGES: gl.constexpr = empty.type.shape[0]
    mbarrier.arrive(empty.index(count % STAGES))
    return acc + block * gl.expand_dims(scale, 1)


@gluon.jit
def _compute_partition(x_smem, w_smem, scale_smem, out_smem, ready, empty, y_desc,
                       w_scale_ptr, num_tiles_m, num_tiles_n, num_k_blocks, blocks_per_split,
                       stride_ws_n, HALF: gl.constexpr, GROUP_M: gl.constexpr,
                       K_UNROLL: gl.constexpr):
    """One compute warpgroup: rows HALF * 64 .. HALF * 64 + 63 of each of the CTA's work
    units, stored at row split * (M rounded up to a tile) + the row of y (split 0 unless K
    is split)."""
    TILE_M: gl.constexpr = x_smem.type.shape[1]
    TILE_N: gl.constexpr = w_smem.type.shape[1]
    ROWS: gl.constexpr = TILE_M // 2
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, TILE_N, 32])
    ROW: gl.constexpr = gl.SliceLayout(1, ACC)
    zeros = gl.zeros([ROWS, TILE_N], gl.float32, ACC)
    staging = out_smem.index(HALF)  # [64, BLOCK_N] of y's dtype
    count = 0
    split_rows = num_tiles_m * TILE_M  # rows of a run's slab of partial sums
    num_units = num_tiles_m * num_tiles_n * gl.cdiv(num_k_blocks, blocks_per_split)
    for unit in range(gl.program_id(0), num_units, gl.num_programs(0)):
        off_m, off_n, split, first_block, end_block = _unit_work(
            unit, num_tiles_m, num_tiles_n, num_k_blocks, blocks_per_split, GROUP_M, TILE_M,
            TILE_N)
        w_scale_row = w_scale_ptr + (off_n // SCALE_ROWS) * stride_ws_n
        acc = zeros
        # K blocks in groups of K_UNROLL, each group a chain: block i + 1's product is issued
        # before block i is waited for and scaled, so the scaling runs under a product. A
        # group starts with nothing in flight: an accumulator still in flight across a loop
        # iteration would be copied at the back edge, and ptxas then serialises every wgmma.
        num_groups = (end_block - first_block) // K_UNROLL
        for group in range(num_groups):
            first = first_block + group * K_UNROLL
            token_prev = _issue_block(x_smem, w_smem, ready, count, zeros, HALF)
            scale_prev = _block_scales(scale_smem, w_scale_row, count, first, HALF, ROW)
            for i in gl.static_range(1, K_UNROLL):
                token = _issue_block(x_smem, w_smem, ready, count + i, zeros, HALF)
                scale = _block_scales(scale_smem, w_scale_row, count + i, first + i, HALF, ROW)
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
            scale = _block_scales(scale_smem, w_scale_row, count, k_block, HALF, ROW)
            acc = _add_scaled(acc, warpgroup_mma_wait(0, deps=[token]), scale, empty, count)
            count += 1
        tma.store_wait(0)  # the previous tile's store has read the staging buffer
        gl.thread_barrier()
        staging.store(acc.to(y_desc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(
            y_desc, [split * split_rows + off_m + HALF * ROWS, off_n], staging)
    tma.store_wait(0)


@gluon.jit
def _block_fp8_matmul_kernel_sm90(
    x_desc,  # x_q [M, K] float8_e4m3fn: box [128, 128]
    w_desc,  # W [N, K] float8_e4m3fn: box [BLOCK_N, 128]
    scale_desc,  # x's scales seen K-major [ceil(K / 128), M] float32 (`tma_ready_scales`):
    # box [1, 128]
    y_desc,  # y [M, N] 16-bit, or with K split the partial sums [runs * M rounded up to 128,
    # N] float32: box [64, BLOCK_N]
    w_scale_ptr,  # [ceil(N / 128), ceil(K / 128)] float32, unit column stride
    M, N, K,
    blocks_per_split,  # K blocks per run (all of them: K not split)
    stride_ws_n,
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
    scale_smem = gl.allocate_shared_memory(gl.float32,
                                           [NUM_STAGES] + scale_desc.block_type.shape,
                                           scale_desc.layout)
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
        (_compute_partition, (x_smem, w_smem, scale_smem, out_smem, ready, empty, y_desc,
                              w_scale_ptr, num_tiles_m, num_tiles_n, num_k_blocks,
                              blocks_per_split, stride_ws_n, TOP, GROUP_M, K_UNROLL)),
        (_compute_partition, (x_smem, w_smem, scale_smem, out_smem, ready, empty, y_desc,
                              w_scale_ptr, num_tiles_m, num_tiles_n, num_k_blocks,
                              blocks_per_split, stride_ws_n, BOTTOM, GROUP_M, K_UNROLL)),
        (_loader_partition, (x_desc, w_desc, scale_desc, x_smem, w_smem, scale_smem, ready,
                             empty, num_tiles_m, num_tiles_n, num_k_blocks, blocks_per_split,
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


def tma_ready_scales(x_scales: torch.Tensor) -> torch.Tensor:
    """x's scales [M, G] float32 as the kernel's TMA reads them: M-major (unit row stride) with
    a column stride of a multiple of 4 floats (16 bytes) and a 16-byte aligned start; copied
    into such a layout (rows padded to 4 in the stride) where they are not. The kernels that
    quantize activations write them so (`empty_quantized`); K-major scales (the CPU's layout)
    or a view into other scales are copied."""
    rows, groups = x_scales.shape
    if (x_scales.stride(0) == 1 and x_scales.stride(1) % 4 == 0
            and x_scales.stride(1) >= rows and x_scales.data_ptr() % 16 == 0):
        return x_scales
    return torch.empty_strided((rows, groups), (1, scales_column_stride(rows)),
                               dtype=torch.float32, device=x_scales.device).copy_(x_scales)


def block_fp8_matmul_sm90(x_q: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                          weight_scale_inv: torch.Tensor, out_dtype: torch.dtype, *,
                          num_stages: int = DEFAULT_STAGES,
                          group_m: int = DEFAULT_GROUP_M,
                          k_unroll: int = DEFAULT_K_UNROLL,
                          block_n: int | None = None,
                          k_splits: int | None = None) -> torch.Tensor:
    """y [M, N] = dequant(x_q, x_scales) @ dequant(weight, weight_scale_inv)^T, the product of
    `fp8_gemm.block_fp8_matmul`, by the warp-specialised sm_90 kernel (where
    `gluon_gemm_serves` holds).

    Args:
        x_q: [M, K] float8_e4m3fn, contiguous; x_scales [M, ceil(K / 128)] float32, any
            strides (`quantize_activations` leaves them M-major; `tma_ready_scales`).
        weight: [N, K] float8_e4m3fn, contiguous; weight_scale_inv [ceil(N / 128),
            ceil(K / 128)] float32.
        out_dtype: bfloat16 or float16.
        num_stages: K blocks in the shared ring; group_m: row tiles per weight-sharing group;
            k_unroll: K blocks per chain of overlapped products (1: each product waited
            for before it is scaled); block_n: the tile width, 128 or 64 (default:
            `choose_block_n`); k_splits: K split into this many runs of K blocks, their
            float32 sums added by a second launch (default: `choose_k_splits`).
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
        block_n = choose_block_n(rows, out_features, num_sms)
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
    x_layout, w_layout, out_layout = operand_layouts(staged_dtype, block_n)
    x_desc = TensorDescriptor.from_tensor(x_q, [BLOCK_M, BLOCK_K], x_layout)
    scale_desc = TensorDescriptor.from_tensor(tma_ready_scales(x_scales).t(), [1, BLOCK_M],
                                              SCALE_LAYOUT)  # [G, M] -> boxes [1, 128]
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, BLOCK_K], w_layout)
    y_desc = TensorDescriptor.from_tensor(out.view(-1, out_features), [BLOCK_M // 2, block_n],
                                          out_layout)  # [splits * slab rows, or M, N]
    num_units = num_tiles_m * triton.cdiv(out_features, block_n) * k_splits
    grid = (min(num_units, num_sms),)
    _block_fp8_matmul_kernel_sm90[grid](
        x_desc, w_desc, scale_desc, y_desc, weight_scale_inv, rows, out_features, cols,
        blocks_per_split, weight_scale_inv.stride(0),
        NUM_STAGES=num_stages, GROUP_M=group_m, K_UNROLL=k_unroll, num_warps=NUM_WARPS)
    if k_splits > 1:
        sum_splits(out, y)
    return y


def compile_for_sm90(out_dtype: torch.dtype = torch.bfloat16, num_stages: int = DEFAULT_STAGES,
                     group_m: int = DEFAULT_GROUP_M, k_unroll: int = DEFAULT_K_UNROLL,
                     block_n: int = 128):
    """The kernel compiled for sm_90 without a GPU (Triton's bundled ptxas), with the argument
    specialisation of a launch from `block_fp8_w8a8` (M of any divisibility; out_dtype
    float32 for the partial sums of a split K): Triton's CompiledKernel (asm["ptx"],
    asm["cubin"], metadata.shared), for resource checks in CPU tests."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = _block_fp8_matmul_kernel_sm90
    out_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[out_dtype]
    x_layout, w_layout, out_layout = operand_layouts(out_dtype, block_n)
    constexprs = dict(NUM_STAGES=num_stages, GROUP_M=group_m, K_UNROLL=k_unroll)
    signature = {
        "x_desc": f"tensordesc<fp8e4nv[{BLOCK_M}, {BLOCK_K}],{x_layout!r}>",
        "w_desc": f"tensordesc<fp8e4nv[{block_n}, {BLOCK_K}],{w_layout!r}>",
        "scale_desc": f"tensordesc<fp32[1, {BLOCK_M}],{SCALE_LAYOUT!r}>",
        "y_desc": f"tensordesc<{out_name}[{BLOCK_M // 2}, {block_n}],{out_layout!r}>",
        "w_scale_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
        "blocks_per_split": "i32", "stride_ws_n": "i32",
    } | {name: "constexpr" for name in constexprs}
    aligned = ["w_scale_ptr", "N", "K", "stride_ws_n"]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})


__all__ = ["block_fp8_matmul_sm90", "choose_block_n", "choose_k_splits", "compile_for_sm90",
           "gluon_gemm_serves", "shared_memory_bytes", "tma_ready_scales"]
