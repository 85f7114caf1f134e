"""`mlaserve bench gemm-tune profile`: where the block-FP8 GEMM's time goes on one sm_90
GPU: the Gluon product beside cuBLASLt's blockwise product, cuBLAS's per-tensor FP8 product (one
scale per operand: the FP8 ceiling without block scaling) and bf16, timed on V3's projection
shapes, and each launched once more inside the NVTX range `profile` (and one of its own,
`projection:tokens:name`) for Nsight Compute. Flags: `mlaserve bench gemm-tune profile --help`
(`gemm_tune.py`); under ncu: ncu --nvtx --nvtx-include "profile/" --clock-control none
--section ... python3 -m mlaserve bench gemm-tune profile --repeats 1.

Shapes are `projection:tokens` of `bench.gemm.projections(deepseek-v3)`. Operands as in
`mlaserve bench gemm-tune gluon` (randn * 0.02 weights, quantized as the model does); the Gluon
and blockwise outputs are gated against the float32 product of the dequantized operands before
timing. Times are medians under CUDA-graph replay; TFLOP/s counts 2 M N K.
"""

import argparse
import sys
from functools import partial

import torch

from mlaserve.bench.gemm import BF16_ROUNDING, FP8_MMA_REL_ERR, load_config, projections, time_calls
from mlaserve.kernels.fp8_activations import quantize_activations
from mlaserve.kernels.fp8_blocks import quantize_block_fp8
from mlaserve.kernels.fp8_gemm import block_fp8_reference, is_sm90, scaled_mm_block_fp8
from mlaserve.kernels.fp8_gemm_sm90 import block_fp8_matmul_sm90
from mlaserve.kernels.testing import relative_error


def products(m: int, n: int, k: int, device: torch.device) -> dict:
    """The four products of x [m, k] and W [n, k], as argument-less calls, by name."""
    gen = torch.Generator(device=device).manual_seed(n * k + m)
    weight = torch.randn(n, k, generator=gen, device=device) * 0.02
    w_fp8, w_scales = quantize_block_fp8(weight)
    w_bf16 = weight.to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
    x_q, x_scales = quantize_activations(x)
    # one scale per operand: a block as large as the tensor
    x_tensor_q, x_tensor_scale = quantize_block_fp8(x, tuple(x.shape))
    w_tensor_q, w_tensor_scale = quantize_block_fp8(weight, tuple(weight.shape))
    want = block_fp8_reference(x_q, x_scales, w_fp8, w_scales)
    gate = FP8_MMA_REL_ERR + BF16_ROUNDING
    calls = {
        "bf16": partial(torch.matmul, x, w_bf16.T),
        "fp8-per-tensor": partial(torch._scaled_mm, x_tensor_q, w_tensor_q.t(),
                                  x_tensor_scale.view(()), w_tensor_scale.view(()),
                                  out_dtype=torch.bfloat16),
        "cublas-blockwise": partial(scaled_mm_block_fp8, x_q, x_scales, w_fp8, w_scales,
                                    torch.bfloat16),
        "gluon": partial(block_fp8_matmul_sm90, x_q, x_scales, w_fp8, w_scales, torch.bfloat16),
    }
    for name in ("cublas-blockwise", "gluon"):
        err = relative_error(calls[name](), want)
        if err > gate:
            raise AssertionError(f"{name} {m}x{n}x{k}: relative error {err:.1e} > {gate:.1e}")
    return calls


def run(args: argparse.Namespace) -> int:
    """Check, time, then launch each product once inside the NVTX ranges."""
    device = torch.device("cuda")
    if not torch.cuda.is_available() or not is_sm90(device):
        print("mlaserve bench gemm-tune profile needs an sm_90 GPU", file=sys.stderr)
        return 2
    shapes = {p.name: p for p in projections(load_config("deepseek-v3"))}
    print(f"{torch.cuda.get_device_name(device)}")
    for spec in args.shapes.split(","):
        name, tokens = spec.rsplit(":", 1)
        proj, m = shapes[name], int(tokens)
        n, k = proj.out_features, proj.in_features
        calls = products(m, n, k, device)
        for label, call in calls.items():
            seconds = time_calls([call], args.repeats)
            print(f"{name:18} M={m:5} N={n:6} K={k:6}  {label:17} {seconds * 1e6:8.1f} us "
                  f"{2 * m * n * k / seconds / 1e12:7.0f} TFLOP/s", flush=True)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        for label, call in calls.items():
            torch.cuda.nvtx.range_push(f"{name}:{m}:{label}")
            call()
            torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    return 0

