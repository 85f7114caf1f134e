"""`mlaserve bench moe`: routed experts at DeepSeek-V2-Lite and DeepSeek-V3 shapes (bf16
activations; bf16 or block-FP8 weights): the Triton kernels of `mlaserve.kernels.fused_moe`
beside the torch grouped-GEMM path, under CUDA-graph replay.

Usage (GPU): mlaserve bench moe [--models v2-lite,v3] [--tokens 1,2,...,8192]
    [--impls triton,triton-swap,grouped] [--weights bf16|fp8] [--calls 20] [--replays 10]
    [--sweep [--configs-dir DIR]] [--out FILE.json]

Per model and token count T: random x, routing drawn uniformly (K distinct experts per token)
with random positive weights, and `copies` copies of the expert weights so that consecutive calls
read different copies and the ~60 MB L2 holds none of a call's weights (the weights a single call
touches already exceed it at V3; V2-Lite takes 3 copies). `triton-swap` is the Triton path with
the default tiles computed transposed (`GemmTiles.swap_ab`: W x^T, so that wgmma takes the
weight's columns as its rows, FP8 operands unconverted). Every implementation is first checked
against the float32 reference (`fused_experts_loop` in float32, TF32 off) with the tolerances of
`mlaserve.kernels.moe.REFERENCE_TOLERANCES`; one that fails is reported and not timed. With
`--weights fp8` each expert is quantized as DeepSeek's checkpoints are (128x128 blocks) and only
the Triton path runs (w8a8: x and the activation quantized per token and 128 columns); its
reference is that computation in float32 from the dequantized operands
(`fused_experts_w8a8_reference`), within `W8A8_REFERENCE_TOLERANCES`. Timing:
`--calls` calls rotating over the copies are captured in one CUDA graph, each of `--replays`
replays is timed by CUDA events, and the median replay / calls is the time per call
(`moe_cases.py`).

The table: microseconds per implementation, the weights the call reads (experts that got at least
one token), GB/s and TFLOP/s of the Triton path, its share of the floor
max(bytes / copy rate, flops / bf16 matmul rate) with both ceilings measured in this run (FP8
products run up to twice the bf16 rate, so with FP8 weights that floor is loose where the
flops set it), and grouped / triton (above 1: Triton is faster). GPU timings vary between
processes by up to ~10%: run it three times and report the range.

--sweep also tries, per T, block_m in {16, 32, 64, 128} (up to 4x the mean rows per expert) and a
few tile shapes for each of the two GEMM kernels, timed separately (the kernels are independent
given block_m), checks each candidate's output, times the best pair end to end, and prints the
best configuration per T; --configs-dir DIR writes them into DIR's tuned file for this GPU model
and weight format (`fused_moe_config.tuned_config_path`; the engine reads
mlaserve/kernels/moe_configs), `moe_sweep.py`.
"""

import argparse
import math
from pathlib import Path

from mlaserve.arg_types import positive_int_list

MODEL_NAMES = ("v2-lite", "v3")  # the shapes of `moe_cases.MODELS`
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192)
IMPLS = ("triton", "triton-swap", "grouped")


def _names(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench moe` flags."""
    parser.add_argument("--models", type=_names, default=list(MODEL_NAMES),
                        help=f"comma-separated, of {', '.join(MODEL_NAMES)}")
    parser.add_argument("--tokens", type=positive_int_list, default=list(TOKENS))
    parser.add_argument("--impls", type=_names, default=["triton", "grouped"],
                        help="comma-separated, of triton, triton-swap, grouped (the loop syncs: "
                             "no graph)")
    parser.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--replays", type=int, default=10, help="timed replays (median)")
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                        help="the experts' weights: bf16, or block-FP8 (Triton only)")
    parser.add_argument("--sweep", action="store_true", help="also search tile configurations")
    parser.add_argument("--configs-dir", default=None,
                        help="with --sweep: write the best configurations into this folder's "
                             "tuned file for the GPU model (mlaserve/kernels/moe_configs is "
                             "the one the engine reads)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def _check_args(args: argparse.Namespace) -> None:
    for name in args.models:
        if name not in MODEL_NAMES:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    for impl in args.impls:
        if impl not in IMPLS:
            raise ValueError(f"unknown or uncapturable implementation {impl!r}")
    if args.configs_dir and not args.sweep:
        raise ValueError("--configs-dir writes what --sweep finds: add --sweep")
    if args.weights == "fp8" and "grouped" in args.impls:
        raise ValueError("--weights fp8 times the Triton paths only (--impls "
                         "triton,triton-swap): the grouped path would dequantize every expert "
                         "per call")


def run(args: argparse.Namespace) -> int:
    """Check and time every (model, T, implementation); print the tables; write --out."""
    _check_args(args)
    import dataclasses
    import json

    import torch
    import triton

    from mlaserve.bench.moe_cases import (
        MODELS,
        check,
        make_case,
        make_weights,
        run_impl,
        time_impl,
    )
    from mlaserve.bench.moe_sweep import print_tuned, sweep, write_tuned
    from mlaserve.kernels.fused_moe_config import moe_config
    from mlaserve.kernels.testing import l2_bytes, measure_ceilings

    if not torch.cuda.is_available():
        raise ValueError("mlaserve bench moe times GPU kernels: it needs a CUDA GPU")
    fp8 = args.weights == "fp8"
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference
    torch.set_float32_matmul_precision("highest")
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton "
          f"{triton.__version__}; copy {ceilings.copy_bytes_per_s / 1e9:.0f} GB/s (read + "
          f"write), bf16 matmul {ceilings.matmul_flops_per_s / 1e12:.0f} TFLOP/s, L2 "
          f"{l2_bytes(torch.device('cuda')) / 2**20:.0f} MiB")
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "triton": triton.__version__, "copy_bytes_per_s": ceilings.copy_bytes_per_s,
                     "matmul_flops_per_s": ceilings.matmul_flops_per_s, "models": {}}
    for name in args.models:
        shape = MODELS[name]
        gate_up, down, scales = make_weights(shape, device, fp8)
        print(f"\n{name}: D={shape.hidden} I={shape.inter} E={shape.num_experts} "
              f"K={shape.top_k}, {len(gate_up)} {args.weights} weight copies of "
              f"{shape.num_experts * shape.expert_bytes(gate_up[0].element_size()) / 1e9:.2f} "
              "GB")
        rows, tuned = [], []
        for num_tokens in args.tokens:
            case = make_case(shape, num_tokens, gate_up, down, scales, device)
            floor_s = max(case.weight_bytes() / ceilings.copy_bytes_per_s,
                          case.flops() / ceilings.matmul_flops_per_s)
            config = moe_config(case.num_pairs, shape.num_experts, shape.hidden, shape.inter,
                                gate_up[0].dtype, device)
            row = {"tokens": num_tokens, "num_pairs": case.num_pairs,
                   "weight_bytes": case.weight_bytes(), "flops": case.flops(),
                   "floor_us": floor_s * 1e6, "triton_config": dataclasses.asdict(config),
                   "us": {}, "errors": {}}
            for impl in args.impls:
                passed, rel_err, cos_gap = check(case, run_impl(case, impl))
                row["errors"][impl] = {"rel_err": rel_err, "cos_gap": cos_gap, "passed": passed}
                if not passed:
                    print(f"  T={num_tokens} {impl}: WRONG OUTPUT (relative error {rel_err:.2e},"
                          f" 1 - cos {cos_gap:.2e}); not timed")
                    continue
                row["us"][impl] = time_impl(case, impl, args.calls, args.replays) * 1e6
            print(f"  T={num_tokens}: " + ", ".join(
                f"{impl} {us:.1f} us" for impl, us in row["us"].items()))
            rows.append(row)
            if args.sweep:
                best = sweep(case, args.calls, args.replays)
                tuned.append({"tokens": num_tokens, "num_pairs": case.num_pairs, **best})
                row["sweep"] = {"config": dataclasses.asdict(best["config"]), "us": best["us"],
                                "default_us": best["default_us"]}
            del case
            torch.cuda.empty_cache()
        print(f"\n{name}, {args.weights} weights, CUDA-graph replay, {len(gate_up)} weight "
              "copies rotated")
        print_table(rows, args.impls)
        if tuned:
            print_tuned(tuned)
        if tuned and args.configs_dir:
            write_tuned(Path(args.configs_dir), (shape.num_experts, shape.hidden, shape.inter),
                        gate_up[0].dtype, tuned)
        results["models"][name] = {"shape": dataclasses.asdict(shape), "weights": args.weights,
                                   "copies": len(gate_up), "rows": rows}
        del gate_up, down, scales
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {args.out}")
    return 0


def print_table(rows: list[dict], impls: list[str]) -> None:
    """One line per T: per implementation microseconds and GB/s of weights read; the Triton
    path's TFLOP/s and share of the floor; grouped / triton."""
    both = {"triton", "grouped"} <= set(impls)
    head = "".join(f"{impl + ' us':>15}{'GB/s':>7}" for impl in impls)
    print(f"{'T':>6}{'GB read':>9}{head}{'TFLOP/s':>9}{'% floor':>9}"
          + (f"{'grp/tri':>9}" if both else ""))
    for row in rows:
        line = f"{row['tokens']:>6}{row['weight_bytes'] / 1e9:>9.3f}"
        for impl in impls:
            us = row["us"].get(impl, math.nan)
            line += f"{us:>15.1f}{row['weight_bytes'] / us / 1e3:>7.0f}"
        triton_us = row["us"].get("triton", math.nan)
        line += f"{row['flops'] / triton_us / 1e6:>9.1f}{100 * row['floor_us'] / triton_us:>8.0f}%"
        if both:
            line += f"{row['us'].get('grouped', math.nan) / triton_us:>9.2f}"
        print(line)
