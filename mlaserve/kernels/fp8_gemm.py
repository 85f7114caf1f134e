"""Block-FP8 GEMM (w8a8), the format DeepSeek-V3/R1 are published in.

y = x W^T with W [N, K] float8_e4m3fn and its float32 scales S_w [ceil(N / 128), ceil(K / 128)]
(one per 128x128 block, `model/fp8.py`), and x [M, K] quantized on the fly per token and group
of 128 columns: x_q [M, K] float8_e4m3fn with S_x [M, ceil(K / 128)], S_x = amax(|x group|) /
448. Then, for the 128-wide K block k,

    y[m, n] = sum_k  S_x[m, k] * S_w[n // 128, k] * sum_{j in block k} x_q[m, j] W[n, j],

so the kernel runs one FP8 tensor-core product per K block in float32 and scales it before
adding it to the accumulator (the scales are constant across a block, so this is exact up to
float32 rounding against the dequantized product). BLOCK_N and BLOCK_K are 128: a tile never
straddles a weight scale block.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.interpreter import prepare_launch
from mlaserve.model.fp8 import (
    BLOCK_SIZE,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_block_fp8,
    quantize_block_fp8,
)

ACTIVATION_BLOCK = (1, BLOCK_SIZE[1])  # one scale per token and 128 columns


@triton.jit
def _quantize_groups_kernel(
    x_ptr,  # [M, K]
    x_q_ptr,  # [M, K] float8_e4m3fn
    scale_ptr,  # [M, ceil(K / 128)] float32, any strides
    K, stride_x, stride_q, stride_sm, stride_sk,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,  # 128 columns per scale
    GROUPS: tl.constexpr,  # groups per program
):
    row = tl.program_id(0)
    first = tl.program_id(1) * GROUPS
    groups = first + tl.arange(0, GROUPS)  # [GROUPS]
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [GROUPS]
    scale = tl.where(amax > 0.0, amax / FP8_MAX, 1.0)
    x_q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(x_q_ptr + row * stride_q + cols, x_q.to(x_q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_sm + groups * stride_sk, scale, mask=groups * GROUP < K)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group quantization: DeepSeek's block quantization with 1 x 128 blocks
    (one Triton kernel on CUDA, `quantize_block_fp8` elsewhere: the interpreter does not round
    float32 to FP8 as the GPU does).

    Args:
        x: [M, K] activations (any float dtype).

    Returns:
        x_q [M, K] float8_e4m3fn and scales [M, ceil(K / 128)] float32 with
        x ~= x_q * scales[:, k // 128] (an all-zero group gets scale 1). On CUDA the scales are
        M-major (strides (1, M)), the layout cuBLASLt's blockwise scaling reads.
    """
    if x.device.type != "cuda":
        return quantize_block_fp8(x, ACTIVATION_BLOCK)
    rows, cols = x.shape
    num_groups = -(-cols // ACTIVATION_BLOCK[1])
    x_q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty_strided((rows, num_groups), (1, rows), dtype=torch.float32,
                                 device=x.device)
    groups_per_program = min(32, triton.next_power_of_2(num_groups))  # up to 4096 columns
    grid = (rows, triton.cdiv(num_groups, groups_per_program))
    _quantize_groups_kernel[grid](x, x_q, scales, cols, x.stride(0), x_q.stride(0),
                                  scales.stride(0), scales.stride(1), FP8_MAX=FP8_MAX,
                                  GROUP=ACTIVATION_BLOCK[1], GROUPS=groups_per_program,
                                  num_warps=8 if groups_per_program >= 16 else 4)
    return x_q, scales


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
    if weight.shape[1] != cols:
        raise ValueError(f"x has {cols} columns, the weight {weight.shape[1]}")
    if tuple(weight_scale_inv.shape) != (-(-out_features // 128), -(-cols // 128)):
        raise ValueError(f"weight_scale_inv {tuple(weight_scale_inv.shape)} does not cover "
                         f"a [{out_features}, {cols}] weight in 128x128 blocks")
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


def cublas_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `block_fp8_linear` takes torch's blockwise scaled matmul (cuBLASLt) for x
    [..., K] and weight [N, K]: on CUDA, K a multiple of 512 (cuBLASLt wants
    the K blocks of the scales in fours) and N a multiple of 16. On the H200 it is the faster
    product on every DeepSeek-V3 projection from 64 tokens on (`mlaserve bench gemm`)."""
    out_features, in_features = weight.shape
    return x.is_cuda and in_features % 512 == 0 and out_features % 16 == 0


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor,
                     weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> y [..., N] in x's dtype: quantize x per token group, then the block-FP8
    product with an FP8 weight [N, K] and its scales: torch's blockwise scaled matmul where
    `cublas_runs` (the rows padded to a multiple of 4, as cuBLASLt needs), else the Triton
    kernel."""
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    rows = flat.shape[0]
    cublas = cublas_runs(x, weight)
    if cublas and rows % 4:
        flat = torch.nn.functional.pad(flat, (0, 0, 0, -rows % 4))  # [M rounded up to 4, K]
    x_q, x_scales = quantize_activations(flat)
    product = scaled_mm_block_fp8 if cublas else block_fp8_matmul
    y = product(x_q, x_scales, weight, weight_scale_inv, x.dtype)[:rows]  # [M, N]
    return y.view(*x.shape[:-1], weight.shape[0])  # [..., N]


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


__all__ = ["block_fp8_linear", "block_fp8_matmul", "block_fp8_reference", "cublas_runs",
           "quantize_activations", "scaled_mm_block_fp8"]
