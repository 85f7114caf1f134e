"""Block-FP8 GEMMs (w8a8, and w8a16 at a few tokens), the format DeepSeek-V3/R1 are published in.

y = x W^T with W [N, K] float8_e4m3fn and its float32 scales S_w [ceil(N / 128), ceil(K / 128)]
(one per 128x128 block, `fp8_blocks.py`), and x [M, K] quantized on the fly per token and group
of 128 columns: x_q [M, K] float8_e4m3fn with S_x [M, ceil(K / 128)], S_x = amax(|x group|) /
448 (`fp8_activations`: by a launch of its own, or by the kernel that produced x, which hands
`QuantizedActivations` to `block_fp8_linear`). Then, for the 128-wide K block k,

    y[m, n] = sum_k  S_x[m, k] * S_w[n // 128, k] * sum_{j in block k} x_q[m, j] W[n, j],

so the kernel runs one FP8 tensor-core product per K block in float32 and scales it before
adding it to the accumulator (the scales are constant across a block, so this is exact up to
float32 rounding against the dequantized product). BLOCK_N and BLOCK_K are 128: a tile never
straddles a weight scale block.

At a few tokens the product reads little but the weight, and quantizing x costs a launch of its
own, so there `fp8_weight_only_matmul` (w8a16) runs instead: x is read as it is (bf16, fp16 or
float32) and each weight tile is converted to x's dtype in registers,

    y[m, n] = sum_k  S_w[n // 128, k] * sum_{j in block k} x[m, j] W[n, j],

a product that reads the weight's FP8 bytes, half of a bf16 weight's (K split in up to 4
runs, so that more programs stream the weight at once). `linear_product_path` picks the
product for `block_fp8_linear`: on a GPU where a model loaded, the one measured fastest for the
weight's shape and x's rows (`fp8_product_table`, DeepGEMM's product among the candidates where
it loads); else by `product_path`'s rules: "weight-only" on CUDA up to `WEIGHT_ONLY_MAX_ROWS`
rows, "gluon" (the warp-specialised sm_90 kernel of `fp8_gemm_sm90`) on an sm_90 GPU for narrow
products, else "cublas" (torch's blockwise scaled matmul) where cuBLASLt takes the shape, else
"gluon" on sm_90 and "triton" elsewhere.
"""

import math

import torch
import triton
import triton.language as tl

from mlaserve.kernels import fp8_product_table
from mlaserve.kernels.fp8_activations import quantize_activations
from mlaserve.kernels.fp8_blocks import (
    ACTIVATION_BLOCK,
    QuantizedActivations,
    dequantize_block_fp8,
)
from mlaserve.kernels.fp8_gemm_common import check_operands, is_sm90, sm_count, sum_splits
from mlaserve.kernels.interpreter import prepare_launch

# Up to this many rows (tokens) a CUDA `block_fp8_linear` runs the weight-only product, for
# weights of at most WEIGHT_ONLY_MAX_WEIGHT_BYTES: on the H200 it beats bf16 and the w8a8 path
# there on V3's narrower projections (`mlaserve bench gemm-tune weight-only`,
# benchmarks/NOTES.md); past 16 rows, or on the 117-264 MB weights of o_proj and the dense MLP,
# cuBLASLt's w8a8 is faster.
WEIGHT_ONLY_MAX_ROWS = 16
WEIGHT_ONLY_MAX_WEIGHT_BYTES = 64 << 20
# An sm_90 GPU runs the Gluon w8a8 product (`fp8_gemm_sm90`) where cuBLASLt takes the shape
# only on narrow products: from GLUON_MIN_ROWS rows, N at most GLUON_MAX_OUT_FEATURES, where
# it takes 64-wide tiles. On the H200 (benchmarks/NOTES.md, products alone) that is V3's
# 2112-wide q_a + kv_a product at 64-1024 tokens, 13-36% faster than cuBLASLt, and a routed
# expert's 4096-wide gate_up at 64-256, 3-20% faster; of V3's other 37 cells cuBLASLt is
# faster on 33, at most 3% slower on 4. The H100 runs keep cuBLASLt on the wider cells
# (benchmarks/fp8/README.md).
GLUON_MIN_ROWS = 64
GLUON_MAX_OUT_FEATURES = 4096
H100_SMS = 132  # the SM count `product_path` assumes unless told (H100 / H200 SXM)
# The weight-only product's tiles are 32 columns wide and split K into at most this many runs
# of at least this many 128-deep K blocks (`weight_only_tiles`; the fastest in the H200 sweep)
WEIGHT_ONLY_BLOCK_N = 32
WEIGHT_ONLY_MAX_SPLITS = 4
WEIGHT_ONLY_MIN_SPLIT_BLOCKS = 14
# Whether the weight-only product multiplies W x^T (the converted weight tile the left operand,
# which Hopper's wgmma can read from registers) rather than x W^T (the converted tile stored to
# shared memory first). W x^T won no 1- or 16-row cell of the H100 sweep
# (benchmarks/fp8/h100/weight_only.log, `mlaserve bench gemm-tune weight-only --swap-ab 0,1`).
WEIGHT_ONLY_SWAP_AB = False


@triton.jit
def _block_fp8_matmul_kernel(
    x_ptr,  # [M, K] float8_e4m3fn
    w_ptr,  # [N, K] float8_e4m3fn
    y_ptr,  # [M, N] output dtype
    x_scale_ptr,  # [M, ceil(K / 128)] float32
    w_scale_ptr,  # [ceil(N / 128), ceil(K / 128)] float32
    M, N, K,
    stride_xm, stride_wn, stride_ym, stride_xsm, stride_xsk, stride_ws,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # 128: one weight scale row per tile
    BLOCK_K: tl.constexpr,  # 128: one scale column per K step
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_block in range(0, tl.cdiv(K, BLOCK_K)):
        cols = k_block * BLOCK_K + offs_k
        k_mask = cols < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + cols[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
        x_scale = tl.load(x_scale_ptr + offs_m * stride_xsm + k_block * stride_xsk, mask=m_mask,
                          other=0.0)
        w_scale = tl.load(w_scale_ptr + pid_n * stride_ws + k_block)
        partial = tl.dot(x, tl.trans(w), out_dtype=tl.float32)  # [BM, BN]
        acc += partial * (x_scale[:, None] * w_scale)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_fp8_matmul(x_q: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                     weight_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                     block_m: int | None = None) -> torch.Tensor:
    """y [M, N] = dequant(x_q, x_scales) @ dequant(weight, weight_scale_inv)^T in float32,
    stored in out_dtype.

    Args:
        x_q: [M, K] float8_e4m3fn and x_scales [M, ceil(K / 128)] float32
            (`quantize_activations`).
        weight: [N, K] float8_e4m3fn, weight_scale_inv [ceil(N / 128), ceil(K / 128)] float32
            (DeepSeek's checkpoint layout).
        block_m: rows per program (default: the fewest of 16, 32, 64 and 128 that cover M,
            with 8 warps and 3 stages at 128 rows, else 4 warps and 4 stages).
    """
    rows, cols = x_q.shape
    out_features = weight.shape[0]
    check_operands(x_q, weight, weight_scale_inv, x_scales)
    prepare_launch(x_q)
    x_q, weight = x_q.contiguous(), weight.contiguous()
    weight_scale_inv = weight_scale_inv.contiguous()
    y = torch.empty(rows, out_features, dtype=out_dtype, device=x_q.device)
    if block_m is None:
        block_m = next((m for m in (16, 32, 64) if rows <= m), 128)
    num_warps, num_stages = (8, 3) if block_m >= 128 else (4, 4)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, 128))
    _block_fp8_matmul_kernel[grid](
        x_q, weight, y, x_scales, weight_scale_inv, rows, out_features, cols,
        x_q.stride(0), weight.stride(0), y.stride(0), x_scales.stride(0), x_scales.stride(1),
        weight_scale_inv.stride(0), BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128,
        num_warps=num_warps, num_stages=num_stages)
    return y


@triton.jit(do_not_specialize=["M", "BLOCKS_PER_SPLIT"])  # one compile per tiling
def _fp8_weight_only_matmul_kernel(
    x_ptr,  # [M, K] bfloat16, float16 or float32
    w_ptr,  # [N, K] float8_e4m3fn
    y_ptr,  # [M, N] x's dtype, or [splits, M, N] float32 partial sums (SPLIT_K); contiguous
    w_scale_ptr,  # [ceil(N / 128), ceil(K / 128)] float32
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_ws,
    BLOCKS_PER_SPLIT,  # K blocks of each split (program_id 2)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # 16, 32, 64 or 128, a divisor of 128: one weight scale row a tile
    BLOCK_K: tl.constexpr,  # 128: one scale column per K block
    K_BLOCKS: tl.constexpr,  # K blocks per loop step (more weight bytes in flight per stage)
    SPLIT_K: tl.constexpr,  # write float32 partial sums of this split's K blocks
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 x (16-bit operands ignore it)
    SWAP_AB: tl.constexpr,  # the converted weight tile is the product's left operand
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    scale_row = (pid_n * BLOCK_N) // 128
    first_block = split * BLOCKS_PER_SPLIT
    end_block = tl.minimum(first_block + BLOCKS_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T's tile
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # pipelined by the launch's num_stages: each stage holds K_BLOCKS weight tiles
    for first in range(first_block, end_block, K_BLOCKS):
        for step in tl.static_range(K_BLOCKS):
            k_block = first + step
            cols = k_block * BLOCK_K + offs_k
            k_mask = (cols < K) & (k_block < end_block)  # also off for a K block past the last
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + cols[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK] FP8
            w_scale = tl.load(w_scale_ptr + scale_row * stride_ws + k_block,
                              mask=k_block < end_block, other=0.0)
            if SWAP_AB:  # W x^T: the converted tile can stay in registers as the left operand
                partial = tl.dot(w.to(x.dtype), tl.trans(x), input_precision=INPUT_PRECISION,
                                 out_dtype=tl.float32)  # [BN, BM]
            else:
                partial = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=INPUT_PRECISION,
                                 out_dtype=tl.float32)  # [BM, BN]
            acc += partial * w_scale
    if SWAP_AB:  # acc [BN, BM] is stored through transposed offsets
        out = offs_n[:, None] + offs_m[None, :] * N
        mask = n_mask[:, None] & m_mask[None, :]
    else:
        out = offs_m[:, None] * N + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K:
        tl.store(y_ptr + split * M * N + out, acc, mask=mask)
    else:
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def weight_only_tiles(rows: int, out_features: int, in_features: int
                      ) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, K splits) of `fp8_weight_only_matmul` for x [rows, K] and a weight
    [N, K].

    BLOCK_M: the fewest of 16, 32 and 64 rows that cover `rows` (64 past that, in several row
    blocks). BLOCK_N: `WEIGHT_ONLY_BLOCK_N`. At these row counts the product streams the
    weight once, and the more programs stream it side by side, the more of it is in flight:
    K is split into up to `WEIGHT_ONLY_MAX_SPLITS` runs of at least
    `WEIGHT_ONLY_MIN_SPLIT_BLOCKS` K blocks (V3's K of 7168 and more: 4; 1536 and 2048: none),
    and a second launch adds the splits' float32 partial sums.
    """
    block_m = next((m for m in (16, 32) if rows <= m), 64)
    k_blocks = -(-in_features // 128)
    k_splits = max(1, min(WEIGHT_ONLY_MAX_SPLITS, k_blocks // WEIGHT_ONLY_MIN_SPLIT_BLOCKS))
    return block_m, WEIGHT_ONLY_BLOCK_N, k_splits


def fp8_weight_only_matmul(x: torch.Tensor, weight: torch.Tensor,
                           weight_scale_inv: torch.Tensor, *, block_n: int | None = None,
                           k_splits: int | None = None, k_blocks: int = 1, num_stages: int = 4,
                           num_warps: int = 4, swap_ab: bool = WEIGHT_ONLY_SWAP_AB
                           ) -> torch.Tensor:
    """y [M, N] = x @ dequant(weight, weight_scale_inv)^T in x's dtype (w8a16).

        y[m, n] = sum_k  S_w[n // 128, k] * sum_{j in block k} x[m, j] W[n, j]

    over the 128-wide K blocks k: each [BLOCK_N, 128] FP8 weight tile is converted to x's dtype
    in registers (float32 x: float32, multiplied in IEEE float32), multiplied with x's tile in
    float32, and the product scaled by the tile's one weight scale before it is added to the
    float32 accumulator. x is not quantized. Made for a few rows (M <= 64), where the product
    is bound by reading the weight, in FP8 half of a bf16 weight's bytes. With K split, each
    split's programs write float32 partial sums [splits, M, N] and a second launch adds them
    and rounds to x's dtype.

    Args:
        x: [M, K] bfloat16, float16 or float32 (any strides).
        weight: [N, K] float8_e4m3fn (any row stride), weight_scale_inv
            [ceil(N / 128), ceil(K / 128)] float32 (DeepSeek's checkpoint layout).
        block_n: columns per program, 16, 32, 64 or 128 (with swap_ab the product's rows:
            Hopper's wgmma takes 64 and more); k_splits: K split into this many runs of K
            blocks (default for both: `weight_only_tiles`);
            k_blocks: 128-wide K blocks per step of the K loop (a pipeline stage holds that
            many weight tiles, so more of the weight is in flight per program);
            num_stages, num_warps: the launch's (software pipelining depth of the K loop,
            warps per program);
            swap_ab: compute each tile as W x^T, [BLOCK_N, BLOCK_M], the converted weight tile
            the left operand (default `WEIGHT_ONLY_SWAP_AB`); these six are for tuning.
    """
    rows, cols = x.shape
    out_features = weight.shape[0]
    check_operands(x, weight, weight_scale_inv)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, not {x.dtype}")
    prepare_launch(x)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    weight_scale_inv = weight_scale_inv.contiguous()
    block_m, default_block_n, default_splits = weight_only_tiles(rows, out_features, cols)
    block_n = default_block_n if block_n is None else block_n
    k_splits = default_splits if k_splits is None else k_splits
    if block_n not in (16, 32, 64, 128):
        raise ValueError(f"block_n must be 16, 32, 64 or 128, not {block_n}")
    if k_blocks not in (1, 2, 4, 8):
        raise ValueError(f"k_blocks must be 1, 2, 4 or 8, not {k_blocks}")
    if k_splits < 1:
        raise ValueError(f"k_splits must be 1 or more, not {k_splits}")
    num_k_blocks = triton.cdiv(cols, 128)
    blocks_per_split = triton.cdiv(num_k_blocks, k_splits)
    k_splits = triton.cdiv(num_k_blocks, blocks_per_split)  # none of them empty
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    out = y if k_splits == 1 else torch.empty(k_splits, rows, out_features,
                                              dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n), k_splits)
    _fp8_weight_only_matmul_kernel[grid](
        x, weight, out, weight_scale_inv, rows, out_features, cols,
        x.stride(0), x.stride(1), weight.stride(0), weight_scale_inv.stride(0),
        blocks_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, K_BLOCKS=k_blocks,
        SPLIT_K=k_splits > 1, INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        SWAP_AB=swap_ab, num_warps=num_warps, num_stages=num_stages)
    if k_splits > 1:
        sum_splits(out, y)
    return y


def product_path(is_cuda: bool, rows: int, out_features: int, in_features: int, *,
                 sm90: bool = False, num_sms: int = H100_SMS) -> str:
    """Which product `block_fp8_linear` runs for x [rows, K] on CUDA (is_cuda; sm90: 16-bit x
    on an sm_90 GPU of num_sms SMs) or not and a weight [N, K]: the one place this is decided.

    - "weight-only": on CUDA from 1 to `WEIGHT_ONLY_MAX_ROWS` rows (0: never) for weights of
      at most `WEIGHT_ONLY_MAX_WEIGHT_BYTES`, `fp8_weight_only_matmul` (there the product is
      bound by reading the weight, and x's quantization would be a launch of its own);
    - "gluon": on sm_90 for narrow products (`GLUON_MIN_ROWS` rows or more, N at most
      `GLUON_MAX_OUT_FEATURES`, and `fp8_gemm_sm90.choose_block_n` taking 64-wide tiles) where
      TMA takes the shape (`fp8_gemm_sm90.gluon_gemm_serves`), the warp-specialised Gluon
      product;
    - "cublas": on CUDA past that, torch's blockwise scaled matmul (cuBLASLt) where it takes
      the shape: K a multiple of 512 (it wants the K blocks of the scales in fours) and N a
      multiple of 16. On the H200 it is the faster w8a8 product on most DeepSeek-V3
      projections (`mlaserve bench gemm`, `mlaserve bench gemm-tune gluon`);
    - "gluon" again on sm_90 for the shapes cuBLASLt refuses (V2-Lite's dense down_proj, K =
      10944), at any row count past the weight-only product's;
    - "triton": else (the CPU included), `block_fp8_matmul` on x quantized per token group.
    """
    if not is_cuda:
        return "triton"
    if 0 < rows <= WEIGHT_ONLY_MAX_ROWS and (
            out_features * in_features <= WEIGHT_ONLY_MAX_WEIGHT_BYTES):
        return "weight-only"
    gluon_serves = False
    if sm90:
        from mlaserve.kernels.fp8_gemm_sm90 import (  # imports gluon
            choose_block_n,
            gluon_gemm_serves,
        )

        gluon_serves = gluon_gemm_serves(rows, out_features, in_features)
        if (gluon_serves and 0 < GLUON_MIN_ROWS <= rows
                and out_features <= GLUON_MAX_OUT_FEATURES
                and choose_block_n(rows, out_features, num_sms) == 64):
            return "gluon"
    if in_features % 512 == 0 and out_features % 16 == 0:
        return "cublas"
    return "gluon" if gluon_serves else "triton"


def linear_product_path(x: torch.Tensor | QuantizedActivations, weight: torch.Tensor) -> str:
    """The product `block_fp8_linear` runs for a Linear's input x [..., K] (as it is, or
    quantized by its producer) and block-FP8 weight [N, K], on x's device, and what a kernel
    producing x asks before it quantizes its output for the product: on CUDA the measured
    choice of the installed `fp8_product_table` for the shapes it has, else `product_path`."""
    rows = math.prod(x.shape[:-1])
    table = fp8_product_table.installed()
    if x.is_cuda and table is not None:
        chosen = table.path(rows, *weight.shape)
        if chosen is not None:
            return chosen
    sm90 = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and is_sm90(x.device)
    return product_path(x.is_cuda, rows, *weight.shape, sm90=sm90,
                        num_sms=sm_count(x.device) if sm90 else H100_SMS)


def block_fp8_linear(x: torch.Tensor | QuantizedActivations, weight: torch.Tensor,
                     weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> y [..., N] in x's dtype with an FP8 weight [N, K] and its scales, by the
    product `linear_product_path` picks: `fp8_weight_only_matmul` on x as it is, or
    `block_fp8_w8a8` through the Gluon kernel, cuBLASLt or the Triton kernel. x may come
    quantized ([M, K]) from the kernel that produced it, where that product is a w8a8 one."""
    path = linear_product_path(x, weight)
    if isinstance(x, QuantizedActivations):
        if path == "weight-only":
            raise ValueError("quantized activations reached the weight-only FP8 product: their "
                             "producer quantizes only for a w8a8 product (linear_product_path)")
        return block_fp8_w8a8(x, weight, weight_scale_inv, path)  # [M, N]
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    if path == "weight-only":
        y = fp8_weight_only_matmul(flat, weight, weight_scale_inv)  # [M, N]
    else:
        y = block_fp8_w8a8(flat, weight, weight_scale_inv, path)  # [M, N]
    return y.view(*x.shape[:-1], weight.shape[0])  # [..., N]


def block_fp8_w8a8(x: torch.Tensor | QuantizedActivations, weight: torch.Tensor,
                   weight_scale_inv: torch.Tensor, path: str) -> torch.Tensor:
    """x [M, K] -> y [M, N] in x's dtype: x quantized per token group (`quantize_activations`)
    unless its producer did, then the block-FP8 product with weight [N, K] and its scales by
    `path` (`linear_product_path`): "gluon" (`fp8_gemm_sm90.block_fp8_matmul_sm90`), "cublas"
    (torch's blockwise scaled matmul, the rows padded to a multiple of 4 as cuBLASLt needs),
    "deepgemm" (`fp8_gemm_deepgemm`) or "triton" (`block_fp8_matmul`)."""
    rows = x.shape[0]
    if isinstance(x, torch.Tensor):
        x = QuantizedActivations(*quantize_activations(x), x.dtype)
    if path == "cublas" and rows % 4:
        x = x.padded_rows(4)  # [M rounded up to 4, K]
    if path == "gluon":
        from mlaserve.kernels.fp8_gemm_sm90 import block_fp8_matmul_sm90

        product = block_fp8_matmul_sm90
    elif path == "cublas":
        product = scaled_mm_block_fp8
    elif path == "triton":
        product = block_fp8_matmul
    elif path == "deepgemm":
        from mlaserve.kernels.fp8_gemm_deepgemm import deep_gemm_block_fp8_matmul

        product = deep_gemm_block_fp8_matmul
    else:
        raise ValueError(f"unknown w8a8 product {path!r} (gluon, cublas, deepgemm or triton)")
    return product(x.values, x.scales, weight, weight_scale_inv, x.dtype)[:rows]  # [M, N]


def scaled_mm_block_fp8(x_q: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                        weight_scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The same product as `block_fp8_matmul` through torch's blockwise scaled matmul (cuBLASLt
    on sm_90: 1x128 scales for x, 128x128 for the weight), [M, N] in out_dtype.

    cuBLASLt wants x's scales M-major and the weight column-major (the transposed view of the
    [N, K] checkpoint layout); it may refuse shapes whose M or K / 128 is not a multiple of 4,
    which raises here (`mlaserve bench gemm` reports such cells as not run).
    """
    functional = torch.nn.functional
    rows, groups = x_scales.shape
    scales_m_major = x_scales  # as `quantize_activations` leaves them on CUDA
    if x_scales.stride() != (1, rows):
        scales_m_major = torch.empty_strided((rows, groups), (1, rows), dtype=torch.float32,
                                             device=x_scales.device).copy_(x_scales)
    return functional.scaled_mm(
        x_q, weight.t(), scales_m_major, functional.ScalingType.BlockWise1x128,
        weight_scale_inv.t(), functional.ScalingType.BlockWise128x128, output_dtype=out_dtype)


def block_fp8_reference(x_q: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                        weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 product of the dequantized operands, [M, N] (the oracle of the kernel)."""
    x = dequantize_block_fp8(x_q, x_scales, block_size=ACTIVATION_BLOCK)  # [M, K]
    w = dequantize_block_fp8(weight, weight_scale_inv)  # [N, K]
    return x @ w.T


__all__ = ["GLUON_MAX_OUT_FEATURES", "GLUON_MIN_ROWS", "WEIGHT_ONLY_MAX_ROWS",
           "block_fp8_linear", "block_fp8_matmul", "block_fp8_reference", "block_fp8_w8a8",
           "check_operands", "fp8_weight_only_matmul", "linear_product_path", "product_path",
           "scaled_mm_block_fp8", "sum_splits", "weight_only_tiles"]
