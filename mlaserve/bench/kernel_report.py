"""Results of the MLA decode sweep: the printed table, the JSON record and the bandwidth plot.

Per backend and cell: µs per call, achieved GB/s and TFLOP/s (the cell's counted bytes and flops
over the time), % of the floor, and the ratio to the best peer (best peer time / time; above 1 is
faster). Peers are the backends that are not mlaserve's own kernels: FlashInfer's.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlaserve.bench.kernel_grid import Cell

PEER_BACKENDS = ("flashinfer", "flashinfer-fa2")


@dataclass
class BackendResult:
    """One backend on one cell. status: "ok" (gated and timed), "failed" (gate or run error:
    never timed) or "skipped" (the backend cannot serve the cell); timing: "graph", "eager"
    or "cpu"; gate: the error metrics of the correctness check; plan: what the backend's plan
    chose to run (`MLABackend.describe_plan`, e.g. the kernel and its configuration)."""

    backend: str
    status: str
    reason: str = ""
    seconds: float | None = None
    gate: dict[str, float] = field(default_factory=dict)
    timing: str = ""
    plan: str = ""


@dataclass
class CellResult:
    """All backends on one cell, with the cell's counted work and floor (None off the GPU)."""

    cell: Cell
    num_bytes: int
    flops: int
    floor_s: float | None
    num_copies: int
    results: list[BackendResult] = field(default_factory=list)

    def best_peer_s(self) -> float | None:
        times = [r.seconds for r in self.results
                 if r.backend in PEER_BACKENDS and r.status == "ok" and r.seconds]
        return min(times) if times else None

    def metrics(self, result: BackendResult) -> dict[str, float | None]:
        """time_us, gbps, tflops, pct_floor, vs_best_peer of one ok result (None otherwise)."""
        if result.status != "ok" or not result.seconds:
            return dict.fromkeys(("time_us", "gbps", "tflops", "pct_floor", "vs_best_peer"))
        seconds = result.seconds
        peer = self.best_peer_s()
        return {
            "time_us": seconds * 1e6,
            "gbps": self.num_bytes / seconds / 1e9,
            "tflops": self.flops / seconds / 1e12,
            "pct_floor": 100 * self.floor_s / seconds if self.floor_s else None,
            "vs_best_peer": peer / seconds if peer else None,
        }


def _fmt(value: float | None, width: int, precision: int, suffix: str = "") -> str:
    text = "-" if value is None else f"{value:.{precision}f}{suffix}"
    return text.rjust(width)


def format_table(cells: list[CellResult]) -> str:
    """The results as a fixed-width text table, one row per cell and backend (kv ~N: a ragged
    cell, lengths drawn up to N; 1-cos: the gate's cosine gap to the float32 reference, 1 - the
    least per-row cosine similarity)."""
    header = (f"{'heads':>5} {'batch':>5} {'kv':>6} {'blk':>4} {'q':>2} {'floor µs':>9}  "
              f"{'backend':<15}{'µs':>9} {'GB/s':>7} {'TFLOP/s':>8} {'%floor':>7} "
              f"{'x peer':>7} {'1-cos':>8}  note")
    lines = [header, "-" * len(header)]
    for cell_result in cells:
        cell = cell_result.cell
        floor_us = cell_result.floor_s * 1e6 if cell_result.floor_s else None
        for result in cell_result.results:
            m = cell_result.metrics(result)
            note = "" if result.status == "ok" else f"{result.status}: {result.reason}"
            kv = f"{'~' if cell.ragged else ''}{cell.kv_len}"  # ~: ragged, lengths up to kv
            lines.append(
                f"{cell.num_heads:>5} {cell.batch_size:>5} {kv:>6} "
                f"{cell.block_size:>4} {cell.q_len:>2} {_fmt(floor_us, 9, 1)}  "
                f"{result.backend:<15}{_fmt(m['time_us'], 9, 1)} {_fmt(m['gbps'], 7, 0)} "
                f"{_fmt(m['tflops'], 8, 1)} {_fmt(m['pct_floor'], 7, 0, '%')} "
                f"{_fmt(m['vs_best_peer'], 7, 3)} {_cos_gap(result.gate)}  {note}".rstrip())
    return "\n".join(lines)


def _cos_gap(gate: dict[str, float]) -> str:
    gap = gate.get("cos_gap")
    return f"{'-':>8}" if gap is None else f"{gap:8.1e}"


def to_json(cells: list[CellResult], header: dict[str, Any]) -> dict[str, Any]:
    """The JSON record: `header` (device, versions, date, command, ceilings, ...) plus cells."""
    records = []
    for cell_result in cells:
        records.append({
            **asdict(cell_result.cell),
            "bytes": cell_result.num_bytes,
            "flops": cell_result.flops,
            "floor_us": cell_result.floor_s * 1e6 if cell_result.floor_s else None,
            "num_copies": cell_result.num_copies,
            "results": [{"backend": r.backend, "status": r.status, "reason": r.reason,
                         "timing": r.timing, "plan": r.plan, "gate": r.gate,
                         **cell_result.metrics(r)}
                        for r in cell_result.results],
        })
    return {**header, "cells": records}


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.write_text(json.dumps(record, indent=2) + "\n")


def plot_bandwidth(path: Path, cells: list[CellResult], title: str,
                   copy_bytes_per_s: float | None) -> None:
    """PNG: achieved GB/s vs batch size per backend, one panel per (heads, kv length).

    Dashed black: the floor's bandwidth (bytes / floor time) per q_len; dotted grey: the
    measured copy rate. Cells at another block size or q_len than the most common one are their
    own series, labelled with it. Ragged cells are in the table and JSON only.
    """
    from matplotlib.figure import Figure

    cells = [c for c in cells if not c.cell.ragged]
    if not cells:
        return

    heads = sorted({c.cell.num_heads for c in cells})
    kv_lens = sorted({c.cell.kv_len for c in cells})
    shapes = [(c.cell.block_size, c.cell.q_len) for c in cells]
    main_shape = max(set(shapes), key=lambda s: (shapes.count(s), -s[1], s[0]))
    backends = list(dict.fromkeys(r.backend for c in cells for r in c.results))
    colors = {name: f"C{i % 10}" for i, name in enumerate(backends)}
    fig = Figure(figsize=(4.8 * len(kv_lens), 3.6 * len(heads)), layout="constrained")
    axes = fig.subplots(len(heads), len(kv_lens), squeeze=False)
    for row, num_heads in enumerate(heads):
        for col, kv_len in enumerate(kv_lens):
            ax = axes[row][col]
            panel = [c for c in cells if (c.cell.num_heads, c.cell.kv_len) == (num_heads, kv_len)]
            series: dict[tuple[str, int, int], list[tuple[int, float]]] = {}
            floors: dict[int, list[tuple[int, float]]] = {}
            for c in panel:
                if c.floor_s:
                    floors.setdefault(c.cell.q_len, []).append(
                        (c.cell.batch_size, c.num_bytes / c.floor_s / 1e9))
                for r in c.results:
                    gbps = c.metrics(r)["gbps"]
                    if gbps is not None:
                        key = (r.backend, c.cell.block_size, c.cell.q_len)
                        series.setdefault(key, []).append((c.cell.batch_size, gbps))
            for (name, block, q_len), points in sorted(series.items()):
                xs, ys = zip(*sorted(points), strict=True)
                label = name if (block, q_len) == main_shape else f"{name} blk{block} q{q_len}"
                ax.plot(xs, ys, marker="o" if (block, q_len) == main_shape else "x",
                        color=colors[name], label=label)
            for q_len, points in sorted(floors.items()):
                xs, ys = zip(*sorted(set(points)), strict=True)
                ax.plot(xs, ys, "k--", linewidth=1, label=f"floor q{q_len}")
            if copy_bytes_per_s:
                ax.axhline(copy_bytes_per_s / 1e9, color="grey", linestyle=":", linewidth=1,
                           label="copy rate")
            if not panel:
                ax.set_visible(False)
                continue
            ax.set_xscale("log", base=2)
            ax.set_title(f"{num_heads} heads, kv {kv_len}")
            ax.set_xlabel("batch size")
            ax.set_ylabel("GB/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
