"""What the block-FP8 GEMM kernels share (fp8_gemm.py's Triton products, fp8_gemm_sm90.py's
Gluon product): the operand check, the device facts they read per call, and the launch that adds
the float32 partial sums of a product whose K was split. Kernels import this, never their
dispatcher (`fp8_gemm.block_fp8_linear`)."""

import functools

import torch
import triton
import triton.language as tl

from mlaserve.kernels.interpreter import prepare_launch


def check_operands(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                   x_scales: torch.Tensor | None = None) -> None:
    """Raise unless weight [N, K] has x [M, K]'s K columns, weight_scale_inv covers it in
    128x128 blocks and (a w8a8 product) x_scales is float32 [M, ceil(K / 128)]: the kernels
    read the scales by these shapes, so a mismatch would read out of bounds."""
    rows, in_features = x.shape
    out_features, cols = weight.shape
    if cols != in_features:
        raise ValueError(f"x has {in_features} columns, the weight {cols}")
    if tuple(weight_scale_inv.shape) != (-(-out_features // 128), -(-cols // 128)):
        raise ValueError(f"weight_scale_inv {tuple(weight_scale_inv.shape)} does not cover "
                         f"a [{out_features}, {cols}] weight in 128x128 blocks")
    if x_scales is not None and (tuple(x_scales.shape) != (rows, -(-cols // 128))
                                 or x_scales.dtype != torch.float32):
        raise ValueError(f"x_scales must be float32 [{rows}, {-(-cols // 128)}] (one per row "
                         f"and 128 columns), not {x_scales.dtype} {tuple(x_scales.shape)}")


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SM count, read once (the FP8 products run per layer per step)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def is_sm90(device: torch.device) -> bool:
    """Whether device is an sm_90 GPU (Hopper), read once per device (the FP8 products ask per
    layer per step)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


@triton.jit
def _sum_splits_kernel(partial_ptr, y_ptr, numel, split_stride, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """y [numel] = the sum over the splits of partial [SPLITS, split_stride] (float32, the
    first numel of each split's elements), in y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        acc += tl.load(partial_ptr + split * split_stride + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def sum_splits(partial: torch.Tensor, y: torch.Tensor) -> None:
    """y [M, N] (contiguous) = the sum of partial [splits, rows >= M, N] (float32, contiguous)
    over its first axis, its first M rows, in y's dtype: the second launch of a product whose
    K was split."""
    prepare_launch(partial)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(y.numel(), block),)](
        partial, y, y.numel(), partial[0].numel(), SPLITS=partial.shape[0], BLOCK=block)
