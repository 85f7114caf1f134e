"""`mlaserve bench moe --sweep`: per token count, block_m and the tiles of each of the fused
MoE's two GEMM kernels searched, each candidate's output checked, and the best configuration
written to the GPU model's tuned file (`fused_moe_config.tuned_config_path`). With FP8 weights the
candidates keep block_k within a scale block, each is tried as stored and transposed
(`swap_ab`), and the gate kernel's time includes the activation's quantization: in its epilogue
where block_n is 128, else the separate launch. Usage: `mlaserve bench moe --help`."""

import dataclasses
import datetime
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from mlaserve.bench.moe_cases import Case, check, graph_seconds, time_config
from mlaserve.kernels.fp8_activations import GROUP, quantize_activations
from mlaserve.kernels.fp8_blocks import QuantizedActivations
from mlaserve.kernels.fused_moe import down_weighted, fused_experts_triton, gate_up_silu
from mlaserve.kernels.fused_moe_config import (
    FusedMoEConfig,
    GemmTiles,
    moe_config,
    tuned_config_path,
    weight_format,
)
from mlaserve.kernels.moe_align import ExpertAlignment, align_by_expert

# (block_n, block_k, group_size_m, num_warps, num_stages) tried for each GEMM kernel.
SWEEP_TILES_SMALL_M = [  # block_m 16 or 32: weight streaming
    (32, 128, 1, 4, 4), (64, 64, 1, 4, 5), (64, 128, 1, 4, 3), (64, 128, 1, 4, 4),
    (64, 256, 1, 4, 3), (128, 64, 1, 4, 4), (128, 128, 1, 4, 3), (64, 128, 1, 8, 4),
]
SWEEP_TILES_LARGE_M = [  # block_m 64 or 128
    (64, 64, 8, 4, 4), (64, 64, 8, 8, 4), (64, 128, 8, 8, 3), (128, 64, 8, 4, 4),
    (128, 64, 8, 8, 3), (128, 64, 8, 8, 4), (128, 128, 8, 8, 3), (64, 64, 16, 4, 4),
]
# FP8 weights: block_k at most one 128-wide scale block, more stages (each holds half the bytes
# of a 16-bit one), 128-wide gate tiles (the epilogue quantizes the activation); each is also
# tried transposed
SWEEP_TILES_SMALL_M_FP8 = [
    (32, 128, 1, 4, 4), (32, 128, 1, 4, 6), (64, 128, 1, 4, 4), (64, 128, 1, 4, 6),
    (128, 128, 1, 4, 3), (128, 128, 1, 4, 5), (128, 128, 1, 8, 4),
]
SWEEP_TILES_LARGE_M_FP8 = [
    (64, 128, 8, 4, 4), (128, 64, 8, 8, 4), (128, 128, 8, 4, 4), (128, 128, 8, 8, 3),
    (256, 128, 8, 8, 3),
]
SWEEP_BLOCK_M = (16, 32, 64, 128)


def _candidates(block_m: int, fp8: bool) -> list[GemmTiles]:
    """The tiles tried for each GEMM kernel at this block_m."""
    if not fp8:
        return [_tiles(c) for c in (SWEEP_TILES_SMALL_M if block_m <= 32
                                    else SWEEP_TILES_LARGE_M)]
    space = SWEEP_TILES_SMALL_M_FP8 if block_m <= 32 else SWEEP_TILES_LARGE_M_FP8
    return [dataclasses.replace(_tiles(c), swap_ab=swap) for c in space for swap in (False, True)]


def _block_ms(rows_per_expert: float) -> list[int]:
    """block_m tried: up to 4x the mean rows per expert (16 at least), and no block under 64
    once experts average more than 64 rows (prefill: small blocks only add weight reads)."""
    return [block_m for block_m in SWEEP_BLOCK_M
            if block_m <= max(16, 4 * rows_per_expert)
            and (rows_per_expert <= 64 or block_m >= 64)]


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
    fp8 = case.scales is not None
    rows_per_expert = case.num_pairs / shape.num_experts
    default = moe_config(case.num_pairs, shape.num_experts, shape.hidden, shape.inter,
                         case.gate_up[0].dtype, case.x.device)
    default_s = time_config(case, default, calls, replays)
    best: tuple[FusedMoEConfig, float] = (default, default_s)
    # the kernels' inputs: with FP8 weights, x and the activation quantized as the path does
    x, x_scales = quantize_activations(case.x) if fp8 else (case.x, None)
    for block_m in _block_ms(rows_per_expert):
        candidates = _candidates(block_m, fp8)
        base = dataclasses.replace(default, block_m=block_m)
        alignment = align_by_expert(case.topk_ids, shape.num_experts, block_m)

        def gate_kernel(tiles: GemmTiles, copy: int, alignment: ExpertAlignment = alignment):
            if not fp8:
                return gate_up_silu(x, case.gate_up[copy], alignment, shape.top_k, tiles)
            in_epilogue = tiles.block_n == GROUP
            act = gate_up_silu(x, case.gate_up[copy], alignment, shape.top_k, tiles,
                               (x_scales, case.scales[0]), act_dtype=case.x.dtype,
                               quantize_act=in_epilogue)
            if in_epilogue:
                return act
            return QuantizedActivations(*quantize_activations(act), case.x.dtype)

        act = gate_kernel(base.gate_up, 0)
        act, act_scales = (act.values, act.scales) if fp8 else (act, None)

        def down_kernel(tiles: GemmTiles, copy: int, alignment: ExpertAlignment = alignment,
                        act: torch.Tensor = act, act_scales: torch.Tensor | None = act_scales):
            return down_weighted(act, case.down[copy], case.topk_weights, alignment, tiles,
                                 None if act_scales is None else (act_scales, case.scales[1]),
                                 out_dtype=case.x.dtype)

        print(f"    block_m {block_m}:")
        gate_up, gate_up_s = _best_tiles(
            case, candidates,
            lambda t, base=base: fused_experts_triton(
                case.x, topk_weights=case.topk_weights, topk_ids=case.topk_ids,
                config=dataclasses.replace(base, gate_up=t), **case.weights(0)),
            gate_kernel, calls, replays)
        down, down_s = _best_tiles(
            case, candidates,
            lambda t, base=base: fused_experts_triton(
                case.x, topk_weights=case.topk_weights, topk_ids=case.topk_ids,
                config=dataclasses.replace(base, down=t), **case.weights(0)),
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


def write_tuned(config_dir: Path, shape: tuple[int, int, int], weights: torch.dtype,
                tuned: list[dict]) -> Path:
    """The sweep's best configuration per T into this GPU model's tuned file
    (`fused_moe_config.tuned_config_path`, which `moe_config` reads), with each one's time, the
    default's and the day it was measured; entries of an existing file for other T stay."""
    device_name = torch.cuda.get_device_name(0)
    path = tuned_config_path(*shape, weight_format(weights), device_name, config_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = (json.loads(path.read_text()) if path.exists()
            else {"device": device_name, "by": "mlaserve bench moe --sweep", "configs": {},
                  "us": {}})
    today = datetime.date.today().isoformat()
    for entry in tuned:
        body["configs"][str(entry["num_pairs"])] = dataclasses.asdict(entry["config"])
        body["us"][str(entry["num_pairs"])] = {
            "tokens": entry["tokens"], "tuned": round(entry["us"], 1),
            "default": round(entry["default_us"], 1), "measured": today,
            "torch": torch.__version__, "triton": triton.__version__}
    for table in ("configs", "us"):
        body[table] = dict(sorted(body[table].items(), key=lambda item: int(item[0])))
    path.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def print_tuned(tuned: list[dict]) -> None:
    """The sweep's best configuration per T, its time and the default's."""
    print("\nbest configuration per T (us: tuned, default):")
    for entry in tuned:
        print(f"  T={entry['tokens']}: {entry['us']:.1f}, {entry['default_us']:.1f}: "
              f"{entry['config']}")
