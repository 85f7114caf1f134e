"""`mlaserve bench gemm-tune gluon`: the warp-specialised sm_90 block-FP8 GEMM
(`fp8_gemm_sm90.block_fp8_matmul_sm90`) at DeepSeek-V3's projection shapes on one H100 / H200:
checked, timed against bf16 and cuBLASLt's blockwise product, and its launch configuration
swept, so that `fp8_gemm.GLUON_MIN_ROWS` and the kernel's defaults can be set from one run.
Flags: `mlaserve bench gemm-tune gluon --help` (`gemm_tune.py`).

Per projection (`bench.gemm.projections`: the GEMMs as the model runs them) and token count M:
random bf16 x and weight (randn * 0.02), quantized as the model does (`quantize_activations`,
`quantize_block_fp8`). Every swept configuration's bf16 output is checked against the float32
product of the same dequantized operands (relative Frobenius error, gate `FP8_MMA_REL_ERR +
BF16_ROUNDING` of `bench.gemm`) before it is timed; a failure is printed and makes the exit
status 1. Times are medians under CUDA-graph replay (`kernels.testing.graph_replay_seconds`):
- `bf16`: x @ w_bf16.T (cuBLAS);
- `cublas`: cuBLASLt's blockwise product alone (`scaled_mm_block_fp8`), where it takes the shape;
- `gluon`: the Gluon product alone with its defaults (the tile width `choose_block_n` picks,
  printed as `bn`, and the runs of K blocks `choose_k_splits` picks, `ks`), and `best`: the
  fastest swept configuration (num_stages, k_unroll, group_m, block_n, k_splits), named;
- `w8a8 cublas` / `w8a8 gluon`: what a layer runs (`block_fp8_w8a8`): x's quantization plus
  the product; `quant`: the quantization alone (`quantize_activations`), with the bytes it
  moves per second (x read, x_q and its scales written).
The table gives microseconds, the Gluon kernel's TFLOP/s and the speed-ups over bf16.
"""

import argparse
import itertools
import json
import math
import sys
from functools import partial
from pathlib import Path

import torch

from mlaserve.bench.gemm import (
    BF16_ROUNDING,
    FP8_MMA_REL_ERR,
    load_config,
    projections,
    time_calls,
)
from mlaserve.kernels.fp8_activations import quantize_activations
from mlaserve.kernels.fp8_blocks import quantize_block_fp8
from mlaserve.kernels.fp8_gemm import (
    block_fp8_reference,
    block_fp8_w8a8,
    scaled_mm_block_fp8,
    sm_count,
)
from mlaserve.kernels.fp8_gemm_sm90 import (
    DEFAULT_GROUP_M,
    DEFAULT_K_UNROLL,
    DEFAULT_STAGES,
    block_fp8_matmul_sm90,
    choose_block_n,
    choose_k_splits,
    gluon_gemm_serves,
    shared_memory_bytes,
)
from mlaserve.kernels.mla_decode.common import GLUON_SHARED_MEMORY_LIMIT as SHARED_LIMIT
from mlaserve.kernels.testing import relative_error


def _time(call, repeats: int) -> float:
    """One call, one weight: `bench.gemm.time_calls` of [call]."""
    return time_calls([call], repeats)


def run(args: argparse.Namespace) -> int:
    """Check, time and sweep every (model, projection, tokens) cell; 1 when an output fails."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("mlaserve bench gemm-tune gluon times an sm_90 kernel: it needs an H100 / H200",
              file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gate = FP8_MMA_REL_ERR + BF16_ROUNDING
    sweep = list(itertools.product(args.stages, args.k_unroll, args.group_m, args.block_n,
                                   args.k_splits))
    print(f"{torch.cuda.get_device_name(device)}; defaults: num_stages {DEFAULT_STAGES}, "
          f"k_unroll {DEFAULT_K_UNROLL}, group_m {DEFAULT_GROUP_M}")
    print(f"{'projection':20} {'N':>6} {'K':>6} {'M':>5}  {'bf16 us':>8} {'cublas':>8} "
          f"{'gluon':>8} {'bn':>3} {'ks':>2} {'best':>8} {'(st,ku,gm,bn,ks)':>17}  "
          f"{'TFLOP/s':>7}  "
          f"{'x cublas':>8} {'x gluon':>7} {'x best':>6}  {'w8a8 cublas':>11} {'w8a8 gluon':>10} "
          f"{'quant':>7} {'GB/s':>5}  rel err",
          flush=True)
    rows, failed = [], False
    for model in args.models.split(","):
        for proj in projections(load_config(model)):
            n, k = proj.out_features, proj.in_features
            gen = torch.Generator(device=device).manual_seed(n * k)
            weight = torch.randn(n, k, generator=gen, device=device) * 0.02
            w_fp8, w_scales = quantize_block_fp8(weight)
            w_bf16 = weight.to(torch.bfloat16)
            del weight
            for m in args.tokens:
                if not gluon_gemm_serves(m, n, k):
                    print(f"{proj.name:20} {n:6} {k:6} {m:5}  not taken by the Gluon kernel")
                    continue
                x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
                x_q, x_scales = quantize_activations(x)
                want = block_fp8_reference(x_q, x_scales, w_fp8, w_scales)  # [M, N]
                product = partial(block_fp8_matmul_sm90, x_q, x_scales, w_fp8, w_scales,
                                  torch.bfloat16)
                rel_err = relative_error(product(), want)
                swept = {}
                for stages, k_unroll, group_m, block_n, k_splits in sweep:
                    staged = torch.bfloat16 if k_splits == 1 else torch.float32
                    if shared_memory_bytes(stages, staged, block_n) > SHARED_LIMIT:
                        continue
                    config = dict(num_stages=stages, k_unroll=k_unroll, group_m=group_m,
                                  block_n=block_n, k_splits=k_splits)
                    err = relative_error(product(**config), want)
                    if err > gate:
                        print(f"  FAIL {proj.name} M={m} {config}: rel err {err:.1e}")
                        failed = True
                        continue
                    swept[(stages, k_unroll, group_m, block_n, k_splits)] = _time(
                        partial(product, **config), args.repeats)
                failed |= rel_err > gate
                bf16 = _time(partial(torch.matmul, x, w_bf16.T), args.repeats)
                gluon = _time(product, args.repeats)  # default_block_n, default_k_splits
                try:
                    cublas = _time(partial(scaled_mm_block_fp8, x_q, x_scales, w_fp8, w_scales,
                                           torch.bfloat16), args.repeats)
                    w8a8_cublas = _time(partial(block_fp8_w8a8, x, w_fp8, w_scales, "cublas"),
                                        args.repeats)
                except (RuntimeError, ValueError, NotImplementedError):
                    cublas = w8a8_cublas = math.nan
                w8a8_gluon = _time(partial(block_fp8_w8a8, x, w_fp8, w_scales, "gluon"),
                                   args.repeats)
                quant = _time(partial(quantize_activations, x), args.repeats)
                quant_bytes = m * k * (2 + 1) + m * -(-k // 128) * 4
                best_config = min(swept, key=swept.get, default=None)
                best = swept[best_config] if best_config else math.nan
                tflops = 2 * m * n * k / gluon / 1e12
                default_block_n = choose_block_n(m, n, sm_count(device))
                default_k_splits = choose_k_splits(m, n, k, default_block_n, sm_count(device))
                rows.append(dict(
                    model=model, projection=proj.name, out_features=n, in_features=k, tokens=m,
                    bf16_us=bf16 * 1e6, cublas_us=cublas * 1e6, gluon_us=gluon * 1e6,
                    best_us=best * 1e6, best_config=best_config, gluon_tflops=tflops,
                    default_block_n=default_block_n, default_k_splits=default_k_splits,
                    w8a8_cublas_us=w8a8_cublas * 1e6, w8a8_gluon_us=w8a8_gluon * 1e6,
                    quant_us=quant * 1e6, rel_err=rel_err,
                    sweep_us={",".join(map(str, key)): t * 1e6 for key, t in swept.items()}))
                best_text = ",".join(map(str, best_config)) if best_config else "-"
                print(f"{proj.name:20} {n:6} {k:6} {m:5}  {bf16 * 1e6:8.1f} {cublas * 1e6:8.1f} "
                      f"{gluon * 1e6:8.1f} {default_block_n:3} {default_k_splits:2} "
                      f"{best * 1e6:8.1f} {best_text:>17}  {tflops:7.0f}  "
                      f"{bf16 / cublas:8.2f} {bf16 / gluon:7.2f} {bf16 / best:6.2f}  "
                      f"{w8a8_cublas * 1e6:11.1f} {w8a8_gluon * 1e6:10.1f} {quant * 1e6:7.1f} "
                      f"{quant_bytes / quant / 1e9:5.0f}  {rel_err:.1e}"
                      f"{'  FAIL' if rel_err > gate else ''}", flush=True)
            del w_fp8, w_bf16
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(device),
                                              "rows": rows}, indent=1) + "\n")
    return 1 if failed else 0

