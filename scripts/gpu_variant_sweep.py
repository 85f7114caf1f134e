#!/usr/bin/env python
"""Time named variants of the Triton decode launch on chosen cells (one GPU, graph replay).

Usage, from the repository root:

    python scripts/gpu_variant_sweep.py [--budget-s 240]      # OUT=dir also writes JSON

Each variant is a change to the cell's default configuration (tiles, split counts,
programmatic launch of the merge kernel on or off); every one is checked against the float32
reference before it is timed, with the same problems, timing and ceilings as
gpu_kernel_sweep.py (KV copies rotated past the L2, median of CUDA-graph replays).
"""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kernel_sweep import Sweep, time_shape  # noqa: E402
from kernel_sweep_space import FA3_ANCHOR_US, Shape  # noqa: E402

TILES_16_ROWS = [(16, 64, 4, 2), (16, 32, 4, 3), (16, 32, 4, 4), (16, 32, 4, 5), (16, 64, 4, 3),
                 (16, 16, 4, 5), (16, 16, 4, 6), (16, 32, 8, 4), (16, 64, 8, 3)]
TILES_32_ROWS = [(32, 64, 4, 2), (32, 32, 4, 3), (32, 32, 4, 4), (32, 16, 4, 5), (32, 64, 4, 3),
                 (32, 32, 8, 4)]
TILES_64_ROWS = [(64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 4), (64, 16, 8, 4)]


def _tile(tile: tuple[int, int, int, int]) -> dict:
    block_m, block_n, num_warps, num_stages = tile
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def variants(shape: Shape) -> list[tuple[str, dict, int | None]]:
    """(name, config changes, forced split count or None) for one cell."""
    if shape.batch == 1:
        out = [("default", {}, None),
               ("no programmatic launch", dict(programmatic_launch=False), None),
               ("warp-specialized n32 s4", dict(block_m=64, warp_specialized=True, block_n=32,
                                                num_stages=4), None)]
        if shape.num_heads >= 64:  # head groups against splits at one request
            ring = dict(block_m=64, warp_specialized=True, block_n=32, num_stages=4,
                        min_split_len=64)  # the Gluon pass, shorter splits allowed
            for count in (16, 33, 66):
                out.append((f"warp-specialized n32 s4 min64 splits{count}", ring, count))
            for tile, counts in (((16, 32, 4, 3), (8, 16)), ((32, 32, 4, 3), (16, 24, 33)),
                                 ((64, 64, 8, 2), (33, 66))):  # Triton programs
                for count in counts:
                    name = f"m{tile[0]} n{tile[1]} s{tile[3]} splits{count}"
                    out.append((name, _tile(tile) | dict(warp_specialized=False), count))
        return out
    rows = shape.num_heads * shape.q_len
    tiles, splits = {16: (TILES_16_ROWS, (2, 4) if shape.batch == 64 else (1, 2)),
                     32: (TILES_32_ROWS, (2, 4)),
                     64: (TILES_64_ROWS, (2, 3, 4))}.get(rows, (TILES_64_ROWS, (1, 2)))
    if shape.block_size < 64:
        tiles = [t for t in tiles if t[1] <= shape.block_size]
    out = [("default", {}, None)]
    if tiles is TILES_16_ROWS:  # 64-token tiles x 2 buffers fill an SM: splits for one per SM
        out.append(("m16 n64 w8 s3 one per SM", dict(block_n=64, num_warps=8, num_stages=3,
                                                      programs_per_sm=1.0), None))
    if tiles is TILES_64_ROWS:
        out.append(("default + TMA loads", dict(tma_loads=True), None))
    if shape.block_size >= 32:  # the Gluon pass: 64-row programs (rows padded)
        ring = dict(block_m=64, warp_specialized=True, block_n=32, num_stages=4,
                    min_split_len=64, max_num_splits=32, programs_per_sm=1.0,
                    split_policy="waves", tma_loads=True)
        name = "warp-specialized n32 s4"
        out.append((name, ring, None))
        for count in (1, 2, 3, 4):
            out.append((f"{name} splits{count}", ring, count))
    for tile in tiles:
        for count in splits:
            name = f"m{tile[0]} n{tile[1]} w{tile[2]} s{tile[3]} splits{count}"
            out.append((name, _tile(tile), count))
            if tile[0] == 64:
                out.append((name + " TMA", _tile(tile) | dict(tma_loads=True), count))
    return out


CELLS = [Shape(16, 64, 1024, 64, 1), Shape(16, 64, 4096, 64, 1), Shape(16, 512, 1024, 64, 1),
         Shape(16, 512, 4096, 32, 1), Shape(16, 64, 4096, 64, 2), Shape(16, 64, 4096, 64, 4),
         Shape(128, 64, 4096, 64, 1), Shape(16, 1, 8192, 64, 1), Shape(16, 1, 1024, 64, 1),
         Shape(128, 1, 8192, 64, 1), Shape(16, 512, 4096, 64, 1), Shape(128, 64, 1024, 64, 1),
         Shape(128, 512, 1024, 64, 1), Shape(128, 1, 4096, 64, 1), Shape(16, 32, 1024, 64, 1),
         Shape(16, 128, 1024, 64, 1), Shape(16, 64, 2048, 64, 1), Shape(16, 200, 1024, 64, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--min-rows", type=int, default=1,
                        help="only cells with at least this many query rows (q_len x heads)")
    parser.add_argument("--match", default="",
                        help="comma-separated variant names (a trailing * matches a prefix)")
    parser.add_argument("--cells", default="",
                        help="comma-separated cells as printed, e.g. 'H16 B64 kv4096 blk64 q2'")
    args = parser.parse_args()
    sweep = Sweep(smoke=False, budget_s=args.budget_s)
    copy_gbs, mm_tflops = sweep.ceilings()
    print(f"{torch.cuda.get_device_name(0)}: copy {copy_gbs:.0f} GB/s, matmul {mm_tflops:.0f} "
          f"TFLOP/s", flush=True)
    results = []
    cells = [c for c in CELLS if c.num_heads * c.q_len >= args.min_rows
             and (not args.cells or str(c) in args.cells.split(","))]
    for shape in cells:
        if sweep.over_budget():
            print(f"budget over: skipped {shape} and after")
            break
        default = sweep.plan(shape, None).config  # the cell's default configuration
        named = variants(shape)
        if args.match:
            parts = args.match.split(",")
            named = [v for v in named if any(v[0] == part or part.endswith("*")
                                             and v[0].startswith(part[:-1]) for part in parts)]
        configs = [dataclasses.replace(default, **changes) for _, changes, _ in named]
        timed = time_shape(sweep, shape, configs, [splits for _, _, splits in named])
        fa3 = FA3_ANCHOR_US.get(shape.key)
        print(f"{shape}  (fa3 earlier: {fa3} us)", flush=True)
        for (name, _, _), entry in zip(named, timed, strict=False):
            us = entry.get("us")
            mark = f"{us:8.1f} us" if us is not None else "  FAILED " + entry.get("error", "check")
            print(f"    {mark}  {name:<44} [{entry['name']}]", flush=True)
            results.append({"variant": name} | entry)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "gpu_variant_sweep.json").write_text(json.dumps(
            {"copy_gbs": copy_gbs, "matmul_tflops": mm_tflops, "results": results}, indent=1))


if __name__ == "__main__":
    main()
