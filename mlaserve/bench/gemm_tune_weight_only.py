"""`mlaserve bench gemm-tune weight-only`: the weight-only block-FP8 product (w8a16,
`fp8_weight_only_matmul`) at DeepSeek-V3's projection shapes on one GPU: checked, timed against
bf16 and the w8a8 path, and its launch configuration swept, so that `WEIGHT_ONLY_MAX_ROWS` and
`weight_only_tiles` can be set from one run. Flags: `mlaserve bench gemm-tune weight-only
--help` (`gemm_tune.py`).

Per weight shape N x K: a random bf16 weight (randn * 0.02), quantized per 128x128 block as the
checkpoints are (`quantize_block_fp8`), and per token count M random bf16 activations x. The
weight-only output is checked against x.float() @ dequant(W)^T (relative Frobenius error, gate
1e-2: bf16's rounding of the output), every swept configuration's output too before it is
timed; a failure is printed and makes the exit status 1. Times (median per call under CUDA-graph
replay, `kernels.testing.graph_replay_seconds`), each call rotating over copies of its weight
so that the L2 holds none of the weight a call reads (as in a model, where every layer has its
own):
- `bf16`: x @ w_bf16.T (cuBLAS);
- `w8a16`: `fp8_weight_only_matmul` with its default configuration (`weight_only_tiles`: its
  tiles and K splits are printed; 4 stages, 4 warps);
- `w8a8`: `block_fp8_w8a8`, the path `block_fp8_linear` runs past `WEIGHT_ONLY_MAX_ROWS`: the
  per-token-group quantization of x plus the product (cuBLASLt where it takes the shape);
- `best`: the fastest of the swept configurations (block_n x k_splits x k_blocks x
  num_stages x num_warps x swap_ab, the last 1 for the W x^T operand order), named; a
  configuration whose ring does not fit shared memory is skipped.
The table gives microseconds, speed-ups over bf16 (above 1: faster than bf16) and the weight
bytes per second of the w8a16 default and of the best configuration, beside the device's copy
rate measured in the same run.
"""

import argparse
import itertools
import json
import math
import sys
from functools import partial
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from mlaserve.bench.gemm import WEIGHT_ONLY_REL_ERR, time_calls
from mlaserve.kernels.fp8_blocks import dequantize_block_fp8, quantize_block_fp8
from mlaserve.kernels.fp8_gemm import (
    WEIGHT_ONLY_MAX_ROWS,
    block_fp8_w8a8,
    fp8_weight_only_matmul,
    product_path,
    weight_only_tiles,
)
from mlaserve.kernels.testing import (
    l2_bytes,
    l2_cold_copies,
    measure_ceilings,
    relative_error,
)


def run(args: argparse.Namespace) -> int:
    """Check, time and sweep every (shape, tokens) cell; 1 when an output fails."""
    if not torch.cuda.is_available():
        print("mlaserve bench gemm-tune weight-only times GPU kernels: it needs a CUDA GPU",
              file=sys.stderr)
        return 2
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    sm90 = (props.major, props.minor) == (9, 0)
    l2 = l2_bytes(device)
    ceilings = measure_ceilings(device, copy_bytes=1 << 28, matmul_n=4096, repeats=5)
    copy_rate = ceilings.copy_bytes_per_s / 1e9
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB, copy rate "
          f"{copy_rate:.0f} GB/s (read + write); WEIGHT_ONLY_MAX_ROWS = {WEIGHT_ONLY_MAX_ROWS}")
    sweep = list(itertools.product(args.block_n, args.k_splits, args.k_blocks, args.stages,
                                   args.warps, args.swap_ab))
    print(f"{'N x K':>12} {'M':>4} {'path':>11}  {'bf16 us':>8} {'w8a16 us':>8} {'w8a8 us':>8} "
          f"{'best us':>8} {'best (bn,sp,kb,st,wp,sw)':>24}  {'x w8a16':>7} {'x w8a8':>6} "
          f"{'x best':>6}  "
          f"{'GB/s':>5} {'best':>5}  {'tiles/splits':>12}  rel err", flush=True)
    rows, failed = [], False
    for shape in args.shapes.split(","):
        out_features, in_features = (int(v) for v in shape.lower().split("x"))
        gen = torch.Generator(device=device).manual_seed(out_features * in_features)
        weight = torch.randn(out_features, in_features, generator=gen, device=device) * 0.02
        w_fp8, w_scales = quantize_block_fp8(weight)
        w_dequantized = dequantize_block_fp8(w_fp8, w_scales)  # [N, K] float32
        w_bf16s = l2_cold_copies(weight.to(torch.bfloat16))
        del weight
        w_fp8s = l2_cold_copies(w_fp8)
        weight_bytes = w_fp8.numel() + w_scales.numel() * 4
        # the w8a8 product `block_fp8_linear` takes past the weight-only rows
        w8a8_path = product_path(True, WEIGHT_ONLY_MAX_ROWS + 1, out_features, in_features,
                                 sm90=sm90)
        for rows_m in args.tokens:
            x = torch.randn(rows_m, in_features, generator=gen, device=device,
                            dtype=torch.bfloat16)
            want = x.float() @ w_dequantized.T  # [M, N]
            rel_err = relative_error(fp8_weight_only_matmul(x, w_fp8, w_scales), want)
            failed |= rel_err > WEIGHT_ONLY_REL_ERR
            bf16 = time_calls([partial(torch.matmul, x, w.T) for w in w_bf16s], args.repeats)
            w8a16 = time_calls(
                [partial(fp8_weight_only_matmul, x, w, w_scales) for w in w_fp8s], args.repeats)
            w8a8 = time_calls([partial(block_fp8_w8a8, x, w, w_scales, w8a8_path)
                          for w in w_fp8s], args.repeats)
            swept = {}
            for block_n, k_splits, k_blocks, num_stages, num_warps, swap_ab in sweep:
                config = dict(block_n=block_n, k_splits=k_splits, k_blocks=k_blocks,
                              num_stages=num_stages, num_warps=num_warps, swap_ab=swap_ab)
                try:
                    y = fp8_weight_only_matmul(x, w_fp8, w_scales, **config)  # [M, N]
                except OutOfResources:  # a ring that does not fit shared memory: not a result
                    continue
                err = relative_error(y, want)
                if err > WEIGHT_ONLY_REL_ERR:
                    print(f"  FAIL {shape} M={rows_m} {config}: rel err {err:.1e}")
                    failed = True
                    continue
                swept[(block_n, k_splits, k_blocks, num_stages, num_warps,
                       int(swap_ab))] = time_calls(
                    [partial(fp8_weight_only_matmul, x, w, w_scales, **config) for w in w_fp8s],
                    args.repeats)
            best_config = min(swept, key=swept.get, default=None)
            best = swept[best_config] if best_config else math.nan
            tiles = weight_only_tiles(rows_m, out_features, in_features)
            path = product_path(True, rows_m, out_features, in_features, sm90=sm90)
            rows.append(dict(
                out_features=out_features, in_features=in_features, tokens=rows_m, path=path,
                bf16_us=bf16 * 1e6, w8a16_us=w8a16 * 1e6, w8a8_us=w8a8 * 1e6,
                w8a8_path=w8a8_path, best_us=best * 1e6, best_config=best_config,
                default_tiles=tiles, rel_err=rel_err,
                sweep_us={",".join(map(str, key)): t * 1e6 for key, t in swept.items()}))
            best_text = ",".join(map(str, best_config)) if best_config else "-"
            print(f"{shape:>12} {rows_m:4} {path:>11}  {bf16 * 1e6:8.1f} {w8a16 * 1e6:8.1f} "
                  f"{w8a8 * 1e6:8.1f} {best * 1e6:8.1f} {best_text:>24}  {bf16 / w8a16:7.2f} "
                  f"{bf16 / w8a8:6.2f} {bf16 / best:6.2f}  {weight_bytes / w8a16 / 1e9:5.0f} "
                  f"{weight_bytes / best / 1e9:5.0f}  {tiles[0]:3}x{tiles[1]:<3}/{tiles[2]:<2} "
                  f"{rel_err:.1e}"
                  f"{'  FAIL' if rel_err > WEIGHT_ONLY_REL_ERR else ''}", flush=True)
        del w_bf16s, w_fp8s, w_dequantized
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": props.name,
                                              "copy_gb_per_s": copy_rate,
                                              "weight_only_max_rows": WEIGHT_ONLY_MAX_ROWS,
                                              "rows": rows}, indent=1) + "\n")
    return 1 if failed else 0

