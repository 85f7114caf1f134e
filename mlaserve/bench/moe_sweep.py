"""`mlaserve bench moe --sweep`: per token count, block_m and the tiles of each of the fused
MoE's two GEMM kernels searched, each candidate's output checked, and the best configuration
printed as `TUNED_CONFIGS` entries of mlaserve/kernels/fused_moe.py. Usage: `mlaserve bench moe
--help`."""

import dataclasses
import math
from collections.abc import Callable

import torch

from mlaserve.bench.moe_cases import DTYPE, Case, check, graph_seconds, time_config
from mlaserve.kernels.fused_moe import (
    FusedMoEConfig,
    GemmTiles,
    down_weighted,
    fused_experts_triton,
    gate_up_silu,
    moe_config,
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
SWEEP_BLOCK_M = (16, 32, 64, 128)


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
