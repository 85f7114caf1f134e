"""`mlaserve bench kernel-diag trace`: timeline of the seesaw Gluon split pass from in-kernel
%globaltimer stamps.

Usage (GPU): mlaserve bench kernel-diag trace [--cells 128x64x1024x1,...] [--out DIR]
Cells are heads x batch x kv length x q_len (block 64, the default plan). The pass is rebuilt
from `gluon_sm90.py` and `gluon_sm90_tiles.py` with timestamps added by text edits
(each edit asserts its anchor, so a changed kernel fails loudly here instead of tracing the
wrong place), written to a temporary folder and imported from their files. Each program records,
as ns of the GPU's global timer: kernel entry, warpgroup 0's start, Q landed, the end of the
first pair and of the tile loop, the end of the epilogue (both warpgroups), the loader's start
and last issue, and the SM. Prints per-cell medians (µs) and writes trace_<cell>.npy.
"""

import argparse
import importlib.util
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from mlaserve.kernels.mla_decode.common import GLUON_SM90, SplitPassIO
from mlaserve.kernels.mla_decode.plan import plan_mla_decode
from mlaserve.kernels.testing import poisoned_paged_batch

KERNELS = Path(__file__).resolve().parents[1] / "kernels" / "mla_decode"
SLOTS = 12  # int64 stamps per program
NOW = '''

@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _smid():
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)
'''


def _edit(source: str, edits: list[tuple]) -> str:
    """Each edit (anchor, replacement[, count]) replaces its anchor, which must occur count
    times (default 1)."""
    for anchor, replacement, *count in edits:
        expected = count[0] if count else 1
        if source.count(anchor) != expected:
            raise SystemExit(f"trace edit anchor found {source.count(anchor)} times, not "
                             f"{expected}: {anchor!r}")
        source = source.replace(anchor, replacement)
    return source


def traced_pass(folder: Path):
    """Writes the stamped copies of the two modules into folder; returns the pass module."""
    tiles = _edit((KERNELS / "gluon_sm90_tiles.py").read_text(), [
        ("\n\n@gluon.jit\ndef loader_partition(", NOW + "\n\n@gluon.jit\ndef loader_partition("),
        ("split_start, num_tiles, BLOCK_SIZE: gl.constexpr):",
         "split_start, num_tiles, trace, BLOCK_SIZE: gl.constexpr):"),
        ("into the ring (tile j -> buffer j % S).\"\"\"\n",
         "into the ring (tile j -> buffer j % S).\"\"\"\n    gl.store(trace + 8, _now())\n"),
        ("kv_ready, bt_row,\n                   split_start, j, BLOCK_SIZE)\n",
         "kv_ready, bt_row,\n                   split_start, j, BLOCK_SIZE)\n"
         "        gl.store(trace + 9, _now())\n"),
    ])
    main = _edit((KERNELS / "gluon_sm90.py").read_text(), [
        ("from mlaserve.kernels.mla_decode.gluon_sm90_tiles import (",
         "from traced_sm90_tiles import _now, _smid\nfrom traced_sm90_tiles import ("),
        ("num_tiles, HALF: gl.constexpr,\n                      DIRECT_OUTPUT",
         "num_tiles, trace, HALF: gl.constexpr,\n                      DIRECT_OUTPUT"),
        ("    mbarrier.wait(q_ready, 0)\n",
         "    if HALF == 0:\n        gl.store(trace + 0, _now())\n"
         "        gl.store(trace + 10, _smid().to(gl.int64))\n"
         "    mbarrier.wait(q_ready, 0)\n"
         "    if HALF == 0:\n        gl.store(trace + 1, _now())\n"),
        ("num_tiles, HALF,\n                                   False)\n",
         "num_tiles, HALF,\n                                   False)\n"
         "        if i == 0:\n            gl.store(trace + 2 + HALF * 3, _now())\n"),
        ("    # l = l_L + l_R:",
         "    gl.store(trace + 3 + HALF * 3, _now())\n    # l = l_L + l_R:"),
        ("        gl.store(lse_ptr + out_base + rows_s, lse, mask=rows_s < num_rows)\n",
         "        gl.store(lse_ptr + out_base + rows_s, lse, mask=rows_s < num_rows)\n"
         "    gl.store(trace + 4 + HALF * 3, _now())\n"),
        ("    stride_bt,\n", "    stride_bt,\n    trace_ptr,\n"),
        ("    bt_row = block_table_ptr + req.to(gl.int64) * stride_bt\n",
         "    bt_row = block_table_ptr + req.to(gl.int64) * stride_bt\n"
         f"    trace = trace_ptr + ((req * num_splits + split) * gl.num_programs(0) + group)"
         f" * {SLOTS}\n    gl.store(trace + 11, _now())\n"),
        # both branches' seesaw calls (16-bit and FP8 caches; the trace runs the 16-bit one)
        ("num_tiles,\n                                 LEFT,",
         "num_tiles, trace,\n                                 LEFT,", 2),
        ("num_tiles,\n                                 RIGHT,",
         "num_tiles, trace,\n                                 RIGHT,", 2),
        ("split_start, num_tiles, BLOCK_SIZE)),", "split_start, num_tiles, trace, BLOCK_SIZE)),"),
        ("io: SplitPassIO) -> None:",
         "io: SplitPassIO,\n                      trace: torch.Tensor | None = None) -> None:"),
        ("io.block_table.stride(0),\n", "io.block_table.stride(0), trace,\n"),
    ])
    (folder / "traced_sm90_tiles.py").write_text(tiles)
    (folder / "traced_sm90.py").write_text(main)
    _load("traced_sm90_tiles", folder / "traced_sm90_tiles.py")  # imported by name by the pass
    return _load("traced_sm90", folder / "traced_sm90.py")


def _load(name: str, path: Path):
    """Import the module at path as `name` (registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def trace_cell(traced, heads: int, batch: int, kv_len: int, q_len: int, num_sms: int):
    """Runs the stamped pass on one cell; returns the stamps [programs, SLOTS] and the plan."""
    q, kv, bt, sl = poisoned_paged_batch([kv_len] * batch, heads, 512, 64, 64, q_len,
                                         torch.bfloat16, 0, device=torch.device("cuda"))
    plan = plan_mla_decode(batch, kv_len, heads, q_len, 512, 64, torch.bfloat16, num_sms, 64,
                           capability=(9, 0))
    splits, rows = plan.num_splits, q_len * heads
    if plan.kernel != GLUON_SM90:
        raise SystemExit(f"{heads}x{batch}x{kv_len}x{q_len} does not run the Gluon pass")
    if splits == 1:
        o = torch.empty(batch * q_len, heads, 512, dtype=q.dtype, device="cuda")
    else:
        o = torch.empty(batch * splits * rows * 512, dtype=torch.float32, device="cuda")
    lse = torch.empty(batch * splits * rows, dtype=torch.float32, device="cuda")
    trace = torch.zeros(batch * splits * plan.num_head_groups * SLOTS, dtype=torch.int64,
                        device="cuda")
    io = SplitPassIO(q, kv, bt, sl, o, lse, math.log2(math.e) / math.sqrt(576), 512, q_len)
    for _ in range(3):  # the last call's stamps are kept
        traced.launch_split_pass(plan, io, trace=trace)
    torch.cuda.synchronize()
    return trace.view(-1, SLOTS).cpu().numpy(), plan


def summarise(stamps: np.ndarray, pairs: int) -> dict:
    us = (stamps - stamps[:, 11].min()) / 1000.0  # [programs, SLOTS], µs from the first entry
    end = np.maximum(us[:, 4], us[:, 7])
    med = lambda values: round(float(np.median(values)), 2)  # noqa: E731
    summary = {
        "programs": len(us), "pairs_per_program": pairs, "span_us": round(float(end.max()), 1),
        "entry_to_q_landed": med(us[:, 1] - us[:, 11]),
        "first_pair_wg0": med(us[:, 2] - us[:, 1]),
        "steady_pair_wg0": round(float(np.median((us[:, 3] - us[:, 2]) / max(pairs - 1, 1))), 3),
        "epilogue_wg0": med(us[:, 4] - us[:, 3]), "epilogue_wg1": med(us[:, 7] - us[:, 6]),
        "program": med(end - us[:, 11]), "loader_last_issue": med(us[:, 9] - us[:, 11]),
    }
    sms = stamps[:, 10]
    gaps = []  # from one program's end to the next one's entry on the same SM
    for sm in np.unique(sms):
        order = np.where(sms == sm)[0]
        order = order[np.argsort(us[order, 11])]
        gaps += [us[b, 11] - end[a] for a, b in zip(order[:-1], order[1:], strict=True)]
    if gaps:
        summary["gap_between_programs_on_an_sm"] = med(gaps)
    return summary


def trace_cells(args: argparse.Namespace) -> None:
    """Trace each cell of --cells; write trace_<cell>.npy and trace_summary.json to --out."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    with tempfile.TemporaryDirectory() as folder:
        traced = traced_pass(Path(folder))
        results = {}
        for cell in args.cells.split(","):
            heads, batch, kv_len, q_len = (int(part) for part in cell.split("x"))
            stamps, plan = trace_cell(traced, heads, batch, kv_len, q_len, num_sms)
            np.save(Path(args.out) / f"trace_{cell}.npy", stamps)
            split_len = math.ceil(kv_len / plan.num_splits)
            tiles = math.ceil(split_len / plan.config.block_n)
            results[cell] = {"splits": plan.num_splits} | summarise(stamps, tiles // 2)
            print(cell, json.dumps(results[cell]), flush=True)
    (Path(args.out) / "trace_summary.json").write_text(json.dumps(results, indent=1))

