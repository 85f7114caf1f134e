"""Split count and tile size of the Triton decode kernel at small batches, under graph replay.

Usage (GPU): python3 scripts/gpu_split_sweep.py [--cells 16x96x1024,...] [--splits 1,2,4]
    [--block-ns 32,64] [--out FILE.json]
For each cell (heads x batch x kv length, block 64, q_len 1) and each (block_n, num_splits),
checks the output against the float32 reference, then times CUDA-graph replay with KV copies
rotated past L2; prints the default plan's time beside the best forced configuration.
"""

import argparse
import dataclasses
import json

import torch

from mlaserve.attention.base import MLAShape
from mlaserve.attention.triton_backend import TritonMLABackend
from mlaserve.bench.kernel_cases import check_output, copies_needed, make_inputs
from mlaserve.bench.kernel_grid import Cell
from mlaserve.bench.kernel_timing import time_graph
from mlaserve.kernels.mla_decode_plan import default_config

L, R, DTYPE = 512, 64, torch.bfloat16
SCALE = (128 + 64) ** -0.5
CELLS = [Cell(16, 1, 1024, 64), Cell(16, 1, 4096, 64), Cell(16, 1, 8192, 64),
         Cell(128, 1, 1024, 64), Cell(128, 1, 8192, 64), Cell(16, 8, 4096, 64),
         Cell(16, 64, 1024, 64)]
SPLITS = (4, 8, 16, 32, 64, 128)


def time_config(cell: Cell, inputs, config) -> float:
    device = inputs.block_table.device
    shape = MLAShape(num_heads=cell.num_heads, kv_lora_rank=L, qk_rope_head_dim=R,
                     block_size=cell.block_size, dtype=DTYPE, device=device, max_q_len=1)
    backend = TritonMLABackend(shape, SCALE)
    backend.config = config

    def check(o: torch.Tensor) -> None:
        gate = check_output(o, None, inputs.ref_o, inputs.ref_lse, DTYPE)
        if not gate.passed:
            raise RuntimeError(f"{cell.label} {config}: {gate.message}")

    return time_graph(backend, inputs, 1, repeats=20, check=check)


def _cells(text: str) -> list[Cell]:
    """'HxBxKV,...' (heads x batch x kv length; block 64) as cells."""
    cells = []
    for item in filter(None, text.split(",")):
        heads, batch, kv_len = (int(part) for part in item.split("x"))
        cells.append(Cell(heads, batch, kv_len, 64))
    return cells


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=_cells, default=CELLS,
                        help="heads x batch x kv length, comma-separated (default: small batches)")
    parser.add_argument("--splits", type=_ints, default=SPLITS)
    parser.add_argument("--block-ns", type=_ints, default=(32, 64))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    records = []
    for cell in args.cells:
        copies = copies_needed(cell, L, R, 2, device)
        inputs = make_inputs(cell, L, R, DTYPE, device, SCALE, copies, seed=0)
        base = default_config(cell.num_heads, 1, L, R, DTYPE, cell.batch_size, cell.kv_len,
                              cell.block_size)
        default_us = time_config(cell, inputs, None) * 1e6
        results = []
        for block_n in args.block_ns:
            for splits in args.splits:
                if splits * block_n > cell.kv_len:
                    continue
                config = dataclasses.replace(base, block_n=block_n, min_split_len=block_n,
                                             max_num_splits=splits, split_policy="fill",
                                             programs_per_sm=1000.0)
                us = time_config(cell, inputs, config) * 1e6
                results.append({"block_n": block_n, "num_splits": splits, "us": us})
        best = min(results, key=lambda r: r["us"])
        print(f"{cell.label}: default {default_us:.1f} us; best {best['us']:.1f} us at "
              f"block_n {best['block_n']}, {best['num_splits']} splits; all: "
              + ", ".join(f"{r['block_n']}/{r['num_splits']}:{r['us']:.1f}" for r in results),
              flush=True)
        records.append({"cell": dataclasses.asdict(cell), "default_us": default_us,
                        "results": results})
        del inputs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
