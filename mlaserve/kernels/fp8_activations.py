"""Activations quantized for the w8a8 block-FP8 GEMMs: DeepSeek's 1 x 128 blocks.

A w8a8 product (`fp8_gemm`) reads x [M, K] as FP8 values x_q [M, K] with one float32 scale per
token and group of 128 columns, S_x [M, ceil(K / 128)]:

    S_x[m, g] = amax_{j in group g} |x[m, j]| / 448        (1 for an all-zero group)
    x_q[m, j] = clamp(x[m, j] / S_x[m, j // 128], -448, 448), rounded to e4m3,

so that x ~= x_q * S_x. `quantize_activations` quantizes a tensor in a launch of its own. The
kernels that produce a w8a8 product's input (RMSNorm, SiLU-and-mul: `fused_norm_rope`) can
instead quantize their output rows where they compute them (`store_quantized_groups`), into a
`QuantizedActivations` from `empty_quantized` (`fp8_blocks`): the output is then written once,
in FP8, and the product reads it without a quantization launch between them. The producer
quantizes its output as rounded to the activations' dtype, so both ways give the same bits.

Layout, what every w8a8 product reads: values row-major; scales M-major (strides (1, M)), the
layout cuBLASLt's blockwise scaling wants (the Triton and Gluon kernels read them by strides).

Triton's CPU interpreter converts float32 to float8_e4m3fn wrongly (a rounding that carries
into the exponent is dropped: 126 becomes 64, not 128). Off CUDA `quantize_activations` is
therefore torch's `quantize_block_fp8`, and `empty_quantized` keeps the values in float32,
unrounded: there the fused kernels' tests check the data flow, and a GPU test the rounding.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.fp8_blocks import (
    ACTIVATION_BLOCK,
    FP8_MAX,
    empty_quantized,
    quantize_block_fp8,
)

GROUP = ACTIVATION_BLOCK[1]


@triton.jit
def store_quantized_groups(y, values_ptr, scales_ptr, row, first_group, n_cols,
                           stride_values, stride_scale_row, stride_scale_group,
                           GROUPS: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr):
    """Quantize and store groups first_group .. first_group + GROUPS - 1 of one row.

    y: [GROUPS, GROUP] float32, the row's values as rounded to the activations' dtype, zero
    past n_cols. Stores y / scale (saturated at +-FP8_MAX, converted to values_ptr's dtype)
    and each group's scale = amax(|y|) / FP8_MAX (1 for an all-zero group). Both divisions
    round correctly (`div_rn`; Triton's `/` is the approximate one on the GPU), so the result
    is `quantize_block_fp8`'s, bit for bit.
    """
    groups = first_group + tl.arange(0, GROUPS)  # [GROUPS]
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    amax = tl.max(tl.abs(y), axis=1)  # [GROUPS]
    scale = tl.where(amax > 0.0, tl.div_rn(amax, FP8_MAX), 1.0)
    y_q = tl.clamp(tl.div_rn(y, scale[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(values_ptr + row * stride_values + cols, y_q.to(values_ptr.dtype.element_ty),
             mask=cols < n_cols)
    tl.store(scales_ptr + row * stride_scale_row + groups * stride_scale_group, scale,
             mask=groups * GROUP < n_cols)


@triton.jit
def _quantize_groups_kernel(
    x_ptr,  # [M, K]
    values_ptr,  # [M, K] float8_e4m3fn
    scales_ptr,  # [M, ceil(K / 128)] float32, any strides
    K, stride_x, stride_values, stride_scale_row, stride_scale_group,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,  # 128 columns per scale
    GROUPS: tl.constexpr,  # groups per program
):
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * GROUPS
    groups = first + tl.arange(0, GROUPS)  # [GROUPS]
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
    store_quantized_groups(x, values_ptr, scales_ptr, row, first, K, stride_values,
                           stride_scale_row, stride_scale_group, GROUPS=GROUPS, GROUP=GROUP,
                           FP8_MAX=FP8_MAX)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group quantization, a launch of its own: DeepSeek's block quantization
    with 1 x 128 blocks (one Triton kernel on CUDA, `quantize_block_fp8` elsewhere).

    Args:
        x: [M, K] activations (any float dtype).

    Returns:
        values [M, K] float8_e4m3fn and scales [M, ceil(K / 128)] float32 with
        x ~= values * scales[:, k // 128] (an all-zero group gets scale 1). On CUDA the scales
        are M-major (strides (1, M rounded up to 4)), the layout cuBLASLt's blockwise
        scaling and the sm_90 GEMM's TMA read.
    """
    if x.device.type != "cuda":
        return quantize_block_fp8(x, ACTIVATION_BLOCK)
    rows, cols = x.shape
    out = empty_quantized(rows, cols, x.dtype, x.device)
    num_groups = out.scales.shape[1]
    groups_per_program = min(32, triton.next_power_of_2(num_groups))  # up to 4096 columns
    grid = (rows, triton.cdiv(num_groups, groups_per_program))
    _quantize_groups_kernel[grid](x, out.values, out.scales, cols, x.stride(0),
                                  out.values.stride(0), *out.scales.stride(), FP8_MAX=FP8_MAX,
                                  GROUP=GROUP, GROUPS=groups_per_program,
                                  num_warps=8 if groups_per_program >= 16 else 4)
    return out.values, out.scales


__all__ = ["GROUP", "quantize_activations", "store_quantized_groups"]
