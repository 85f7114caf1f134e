"""Routed experts at DeepSeek-V2-Lite and DeepSeek-V3 shapes (bf16 activations; bf16 or
block-FP8 weights): the Triton kernels of `mlaserve.kernels.fused_moe` beside the torch
grouped-GEMM path, under CUDA-graph replay.

Usage (GPU): python3 scripts/gpu_moe_bench.py [--models v2-lite,v3] [--tokens 1,2,...,8192]
    [--impls triton,triton-swap,grouped] [--weights bf16|fp8] [--calls 20] [--replays 10]
    [--sweep]
    [--out FILE.json]

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
replays is timed by CUDA events, and the median replay / calls is the time per call.

The table: microseconds per implementation, the weights the call reads (experts that got at least
one token), GB/s and TFLOP/s of the Triton path, its share of the floor
max(bytes / copy rate, flops / bf16 matmul rate) with both ceilings measured in this run (FP8
products run up to twice the bf16 rate, so with FP8 weights that floor is loose where the
flops set it), and grouped / triton (above 1: Triton is faster). GPU timings vary between
processes by up to ~10%: run the script three times and report the range.

--sweep also tries, per T, block_m in {16, 32, 64, 128} (up to 4x the mean rows per expert) and a
few tile shapes for each of the two GEMM kernels, timed separately (the kernels are independent
given block_m), checks each candidate's output, times the best pair end to end, and prints the
best configuration per T as entries for `TUNED_CONFIGS` in mlaserve/kernels/fused_moe.py.
"""

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from mlaserve.arg_types import positive_int_list
from mlaserve.kernels.fp8_blocks import quantize_block_fp8
from mlaserve.kernels.fused_moe import (
    FusedMoEConfig,
    GemmTiles,
    down_weighted,
    fused_experts_triton,
    gate_up_silu,
    moe_config,
)
from mlaserve.kernels.moe import (
    REFERENCE_TOLERANCES,
    W8A8_REFERENCE_TOLERANCES,
    fused_experts,
    fused_experts_loop,
    fused_experts_w8a8_reference,
    reference_errors,
)
from mlaserve.kernels.moe_align import ExpertAlignment, align_by_expert
from mlaserve.kernels.testing import l2_bytes, measure_ceilings

DTYPE = torch.bfloat16
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192)


@dataclass(frozen=True)
class MoEShape:
    """Routed-expert dimensions of one model."""

    hidden: int  # D
    inter: int  # I (moe_intermediate_size)
    num_experts: int  # E
    top_k: int  # K

    def expert_bytes(self, element_size: int) -> int:
        """Bytes of one expert's gate, up and down weights."""
        return 3 * self.inter * self.hidden * element_size


MODELS = {
    "v2-lite": MoEShape(hidden=2048, inter=1408, num_experts=64, top_k=6),
    "v3": MoEShape(hidden=7168, inter=2048, num_experts=256, top_k=8),
}

# (block_n, block_k, group_size_m, num_warps, num_stages) tried for each GEMM kernel.
SWEEP_TILES_SMALL_M = [  # block_m 16 or 32: weight streaming
    (32, 128, 1, 4, 4), (64, 64, 1, 4, 5), (64, 128, 1, 4, 3), (64, 128, 1, 4, 4),
    (64, 256, 1, 4, 3), (128, 64, 1, 4, 4), (128, 128, 1, 4, 3), (64, 128, 1, 8, 4),
]
SWEEP_TILES_LARGE_M = [  # block_m 64 or 128
    (64, 64, 8, 4, 4), (64, 64, 8, 8, 4), (64, 128, 8, 8, 3), (128, 64, 8, 4, 4),
    (128, 64, 8, 8, 3), (128, 64, 8, 8, 4), (128, 128, 8, 8, 3), (64, 64, 16, 4, 4),
]
SWEEP_BLOCK_M = (16, 32, 64, 128)


@dataclass
class Case:
    """Inputs of one (model, T): copies of the weights, and the float32 reference output."""

    shape: MoEShape
    x: torch.Tensor  # [T, D] bf16
    gate_up: list[torch.Tensor]  # copies of [E, 2I, D] bf16 or float8_e4m3fn
    down: list[torch.Tensor]  # copies of [E, D, I] bf16 or float8_e4m3fn
    topk_weights: torch.Tensor  # [T, K] float32
    topk_ids: torch.Tensor  # [T, K] int64
    ref: torch.Tensor  # [T, D] float32
    scales: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8: the stacks' block scales

    def weights(self, copy: int) -> dict[str, torch.Tensor | None]:
        """`fused_experts`' weight arguments for weight copy `copy` (the copies share scales)."""
        gate_up_scale_inv, down_scale_inv = self.scales or (None, None)
        return dict(gate_up_proj=self.gate_up[copy], down_proj=self.down[copy],
                    gate_up_scale_inv=gate_up_scale_inv, down_scale_inv=down_scale_inv)

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def num_pairs(self) -> int:
        return self.topk_ids.numel()

    def weight_bytes(self) -> int:
        """Weights one call reads: every expert that got at least one token."""
        return self.topk_ids.unique().numel() * self.shape.expert_bytes(
            self.gate_up[0].element_size())

    def flops(self) -> int:
        return 2 * self.num_pairs * 3 * self.shape.inter * self.shape.hidden


def make_weights(shape: MoEShape, device: torch.device, fp8: bool
                 ) -> tuple[list, list, tuple[torch.Tensor, torch.Tensor] | None]:
    """Identical copies of (gate_up_proj [E, 2I, D], down_proj [E, D, I]), as many as keep a
    call's smallest weight set (K experts) out of L2 between two reads of one copy (at least 2,
    if they fit in 60% of free memory); with fp8 the stacks are block-FP8 and their scales
    (gate_up [E, 2I / 128, ceil(D / 128)], down [E, ceil(D / 128), I / 128]) come third."""
    generator = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(shape.num_experts, 2 * shape.inter, shape.hidden, generator=generator,
                          device=device, dtype=DTYPE).mul_(shape.hidden ** -0.5)
    down = torch.randn(shape.num_experts, shape.hidden, shape.inter, generator=generator,
                       device=device, dtype=DTYPE).mul_(shape.inter ** -0.5)
    scales = None
    if fp8:
        (gate_up, gate_up_scales), (down, down_scales) = (quantize_block_fp8(gate_up),
                                                          quantize_block_fp8(down))
        scales = (gate_up_scales, down_scales)
    element_size = gate_up.element_size()
    copy_bytes = shape.num_experts * shape.expert_bytes(element_size)
    smallest_call = shape.top_k * shape.expert_bytes(element_size)
    wanted = max(2, 1 + math.ceil(2 * l2_bytes(torch.device("cuda")) / smallest_call))
    free, _ = torch.cuda.mem_get_info()
    copies = max(1, min(wanted, 1 + int(0.6 * free) // copy_bytes))
    if copies < wanted:
        print(f"  only {copies} weight copies fit (wanted {wanted})")
    return ([gate_up] + [gate_up.clone() for _ in range(copies - 1)],
            [down] + [down.clone() for _ in range(copies - 1)], scales)


def make_case(shape: MoEShape, num_tokens: int, gate_up: list, down: list,
              scales: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device) -> Case:
    generator = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, shape.hidden, generator=generator, device=device, dtype=DTYPE)
    scores = torch.rand(num_tokens, shape.num_experts, generator=generator, device=device)
    topk_ids = scores.topk(shape.top_k, dim=-1).indices  # [T, K] distinct, uniform
    topk_weights = torch.rand(num_tokens, shape.top_k, generator=generator, device=device)
    topk_weights = topk_weights.softmax(dim=-1)
    if scales is None:
        ref = fused_experts_loop(x, gate_up[0], down[0], topk_weights, topk_ids,
                                 compute_dtype=torch.float32)
    else:
        ref = fused_experts_w8a8_reference(x, gate_up[0], down[0], topk_weights, topk_ids,
                                           *scales)
    return Case(shape, x, gate_up, down, topk_weights, topk_ids, ref, scales)


def check(case: Case, out: torch.Tensor) -> tuple[bool, float, float]:
    """(passed, relative error, 1 - least per-row cosine) against the float32 reference."""
    rel_err, cos_gap = reference_errors(out, case.ref)
    rel_bound, cos_bound = (REFERENCE_TOLERANCES[DTYPE] if case.scales is None
                            else W8A8_REFERENCE_TOLERANCES)
    return rel_err < rel_bound and cos_gap < cos_bound, rel_err, cos_gap


def graph_seconds(call: Callable[[int], object], num_copies: int, calls: int,
                  replays: int) -> float:
    """Median seconds per call: `calls` calls of call(copy), rotating over the copies, captured
    in one CUDA graph; each replay between two CUDA events."""
    for copy in range(num_copies):  # compile and warm up outside the capture
        call(copy)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % num_copies)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    torch.cuda.empty_cache()
    return statistics.median(times) / calls


def run_impl(case: Case, impl: str, copy: int = 0) -> torch.Tensor:
    """One call of `impl` on weight copy `copy`: "triton", "grouped", or "triton-swap" (the
    Triton path with its default tiles computed transposed)."""
    if impl != "triton-swap":
        return fused_experts(case.x, topk_weights=case.topk_weights, topk_ids=case.topk_ids,
                             impl=impl, **case.weights(copy))
    shape = case.shape
    config = moe_config(case.num_pairs, shape.num_experts, shape.hidden, shape.inter,
                        case.gate_up[0].dtype)
    config = dataclasses.replace(
        config, gate_up=dataclasses.replace(config.gate_up, swap_ab=True),
        down=dataclasses.replace(config.down, swap_ab=True))
    return fused_experts_triton(case.x, topk_weights=case.topk_weights,
                                topk_ids=case.topk_ids, config=config, **case.weights(copy))


def time_impl(case: Case, impl: str, calls: int, replays: int) -> float:
    def call(copy: int) -> torch.Tensor:
        return run_impl(case, impl, copy)

    return graph_seconds(call, len(case.gate_up), calls, replays)


def time_config(case: Case, config: FusedMoEConfig, calls: int, replays: int) -> float:
    def call(copy: int) -> torch.Tensor:
        return fused_experts_triton(case.x, case.gate_up[copy], case.down[copy],
                                    case.topk_weights, case.topk_ids, config=config)

    return graph_seconds(call, len(case.gate_up), calls, replays)


def _tiles(candidate: tuple[int, int, int, int, int]) -> GemmTiles:
    block_n, block_k, group_size_m, num_warps, num_stages = candidate
    return GemmTiles(block_n, block_k, group_size_m, num_warps, num_stages)


def _best_tiles(case: Case, candidates: list[GemmTiles], output: Callable[[GemmTiles], object],
                kernel: Callable[[GemmTiles, int], object], calls: int,
                replays: int) -> tuple[GemmTiles | None, float]:
    """The fastest candidate whose full output passes the check: (tiles, seconds per call)."""
    best, best_s = None, math.inf
    for tiles in candidates:
        try:
            passed, rel_err, cos_gap = check(case, output(tiles))
            if not passed:
                print(f"      {tiles}: wrong output (rel {rel_err:.2e}, 1-cos {cos_gap:.2e})")
                continue
            seconds = graph_seconds(lambda copy, tiles=tiles: kernel(tiles, copy),
                                    len(case.gate_up), calls, replays)
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: skip the tiles
            print(f"      {tiles}: {type(error).__name__}: {str(error).splitlines()[0][:100]}")
            continue
        if seconds < best_s:
            best, best_s = tiles, seconds
    return best, best_s


def sweep(case: Case, calls: int, replays: int) -> dict:
    """Best configuration for this T: per block_m, the fastest tiles of each kernel, then the
    fastest block_m end to end."""
    shape = case.shape
    rows_per_expert = case.num_pairs / shape.num_experts
    default = moe_config(case.num_pairs, shape.num_experts, shape.hidden, shape.inter, DTYPE)
    default_s = time_config(case, default, calls, replays)
    best: tuple[FusedMoEConfig, float] = (default, default_s)
    for block_m in SWEEP_BLOCK_M:
        if block_m > max(16, 4 * rows_per_expert):
            continue
        space = SWEEP_TILES_SMALL_M if block_m <= 32 else SWEEP_TILES_LARGE_M
        candidates = [_tiles(c) for c in space]
        base = dataclasses.replace(default, block_m=block_m)
        alignment = align_by_expert(case.topk_ids, shape.num_experts, block_m)
        act = gate_up_silu(case.x, case.gate_up[0], alignment, shape.top_k, base.gate_up)

        def gate_kernel(tiles: GemmTiles, copy: int, alignment: ExpertAlignment = alignment):
            return gate_up_silu(case.x, case.gate_up[copy], alignment, shape.top_k, tiles)

        def down_kernel(tiles: GemmTiles, copy: int, alignment: ExpertAlignment = alignment,
                        act: torch.Tensor = act):
            return down_weighted(act, case.down[copy], case.topk_weights, alignment, tiles)

        print(f"    block_m {block_m}:")
        gate_up, gate_up_s = _best_tiles(
            case, candidates,
            lambda t, base=base: fused_experts_triton(
                case.x, case.gate_up[0], case.down[0], case.topk_weights, case.topk_ids,
                config=dataclasses.replace(base, gate_up=t)),
            gate_kernel, calls, replays)
        down, down_s = _best_tiles(
            case, candidates,
            lambda t, base=base: fused_experts_triton(
                case.x, case.gate_up[0], case.down[0], case.topk_weights, case.topk_ids,
                config=dataclasses.replace(base, down=t)),
            down_kernel, calls, replays)
        if gate_up is None or down is None:
            continue
        config = FusedMoEConfig(block_m, gate_up, down)
        total_s = time_config(case, config, calls, replays)
        print(f"      gate_up {gate_up_s * 1e6:.1f} us, down {down_s * 1e6:.1f} us, "
              f"end to end {total_s * 1e6:.1f} us")
        if total_s < best[1]:
            best = (config, total_s)
    return {"config": best[0], "us": best[1] * 1e6, "default": default, "default_us":
            default_s * 1e6}


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


def _tiles_repr(tiles: GemmTiles) -> str:
    return (f"GemmTiles(block_n={tiles.block_n}, block_k={tiles.block_k}, "
            f"group_size_m={tiles.group_size_m}, num_warps={tiles.num_warps}, "
            f"num_stages={tiles.num_stages})")


def print_tuned(key: tuple[int, int, int], tuned: list[dict]) -> None:
    """The sweep's best configurations as a `TUNED_CONFIGS` entry (lines within 100 columns)."""
    print(f"\n# TUNED_CONFIGS entry for (E, D, I) = {key}, {torch.cuda.get_device_name(0)}, bf16")
    print(f"{key}: {{")
    for entry in tuned:
        config = entry["config"]
        print(f"    {entry['num_pairs']}: FusedMoEConfig(  # T={entry['tokens']}: "
              f"{entry['us']:.1f} us, default {entry['default_us']:.1f} us")
        print(f"        block_m={config.block_m},")
        print(f"        gate_up={_tiles_repr(config.gate_up)},")
        print(f"        down={_tiles_repr(config.down)}),")
    print("},")


def _names(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=_names, default=list(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--tokens", type=positive_int_list, default=list(TOKENS))
    parser.add_argument("--impls", type=_names, default=["triton", "grouped"],
                        help="comma-separated, of triton, triton-swap, grouped (the loop syncs: "
                             "no graph)")
    parser.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--replays", type=int, default=10, help="timed replays (median)")
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                        help="the experts' weights: bf16, or block-FP8 (Triton only)")
    parser.add_argument("--sweep", action="store_true", help="also search tile configurations")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    for name in args.models:
        if name not in MODELS:
            sys.exit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    for impl in args.impls:
        if impl not in ("triton", "triton-swap", "grouped"):
            sys.exit(f"unknown or uncapturable implementation {impl!r}")
    fp8 = args.weights == "fp8"
    if fp8 and ("grouped" in args.impls or args.sweep):
        sys.exit("--weights fp8 times the Triton paths only (--impls triton,triton-swap), "
                 "without --sweep: the grouped path would dequantize every expert per call")
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
                                gate_up[0].dtype)
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
            print_tuned((shape.num_experts, shape.hidden, shape.inter), tuned)
        results["models"][name] = {"shape": dataclasses.asdict(shape), "weights": args.weights,
                                   "copies": len(gate_up), "rows": rows}
        del gate_up, down, scales
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
