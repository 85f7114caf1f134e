"""`mlaserve bench kernel`: paged MLA decode backends side by side, against the roofline.

For every cell of the grid (heads x batch x kv length x block size x q_len, or a preset: the
anchor grid of DeepSeek decode shapes, or `coverage`, which adds page sizes and ragged
batches) this builds random q and a paged cache with shuffled pages and NaN in every unused
page and block tail, checks each backend against the float32 reference
(a backend that fails is reported and never timed), then times it: CUDA-graph replay of 16
calls per graph by default, or eager `do_bench`, with KV copies rotated past the L2 cache. The
copy and matmul ceilings are measured in the same run; each time is reported as µs, GB/s,
TFLOP/s, % of the floor and as a ratio to the best peer (FlashInfer). The table is printed; JSON
and a bandwidth plot go to --out. Under each cell it prints what each backend's plan chose to run
(for triton: the kernel, `triton_split` or `gluon_sm90`, and its configuration); `--sweep` adds
variants of the triton backend's plan as further rows (`kernel_sweep.py`), and `--ragged` a
ragged twin of each cell (lengths drawn up to its kv length). Inputs, the gate
and the timers are the shared harness of `mlaserve.kernels.testing`. Without CUDA it still runs
(tiny shapes, for tests): wall-clock timing, no graphs, no ceilings.
"""

import argparse
import dataclasses
import importlib.metadata
import platform
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

import mlaserve
from mlaserve.arg_types import positive_int, positive_int_list
from mlaserve.attention import registry
from mlaserve.attention.base import MLABackend, MLAShape, UnsupportedShape
from mlaserve.bench.kernel_cases import CellInputs, copies_needed, make_inputs
from mlaserve.bench.kernel_grid import (
    Cell,
    anchor_cells,
    coverage_cells,
    decode_bytes,
    decode_flops,
    flag_cells,
    floor_seconds,
    replay_cells,
)
from mlaserve.bench.kernel_report import (
    PEER_BACKENDS,
    BackendResult,
    CellResult,
    format_table,
    plot_bandwidth,
    to_json,
    write_json,
)
from mlaserve.bench.kernel_sweep import (
    SWEPT_BACKEND,
    apply_variant,
    parse_sweep,
    split_variant,
    variant_name,
)
from mlaserve.bench.kernel_timing import time_cpu, time_eager, time_graph
from mlaserve.cache.latent_dtype import resolve_kv_cache_dtype
from mlaserve.config import parse_dtype
from mlaserve.engine.decode_record import read_decode_steps
from mlaserve.kernels.testing import Ceilings, compare, measure_ceilings
from mlaserve.option_values import KV_CACHE_DTYPE_NAMES

DEFAULT_BACKENDS = ("torch", "triton", "flashinfer")
GRID_FLAGS = ("heads", "batch_sizes", "kv_lens", "block_sizes", "q_lens")
GRID_DEFAULTS = {"heads": [16, 128], "batch_sizes": [1, 64, 512], "kv_lens": [1024, 4096],
                 "block_sizes": [64], "q_lens": [1]}
# DeepSeek-V2/V3 qk_nope_head_dim: the softmax scale is 1 / sqrt(128 + rope_dim).
QK_NOPE_HEAD_DIM = 128
JSON_NAME, PLOT_NAME = "kernel_bench.json", "kernel_bench.png"
PRESETS = {"anchor": anchor_cells, "coverage": coverage_cells}  # --grid NAME: fixed cells


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench kernel` flags."""
    known = ", ".join([*registry.available_backends(), *registry.peer_backends()])
    parser.add_argument("--backends", default=None,
                        help=f"comma list of {known} (default: those of "
                             f"{', '.join(DEFAULT_BACKENDS)} that can run here)")
    parser.add_argument("--grid", choices=tuple(PRESETS) + ("flags",), default="flags",
                        help="flags: the product of the grid flags; anchor: exactly the cells of "
                             "the H200 peer tables; coverage: anchor plus block sizes 16, 32 "
                             "and 128 and ragged batches (presets fix the cells: leave the grid "
                             "flags out)")
    for flag, dest in (("--heads", "heads"), ("--batch-sizes", "batch_sizes"),
                       ("--kv-lens", "kv_lens"), ("--block-sizes", "block_sizes"),
                       ("--q-lens", "q_lens")):
        default = ",".join(map(str, GRID_DEFAULTS[dest]))
        parser.add_argument(flag, dest=dest, type=positive_int_list, default=None,
                            help=f"comma list (default {default})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--graph", dest="mode", action="store_const", const="graph",
                      help="time CUDA-graph replays (default)")
    mode.add_argument("--eager", dest="mode", action="store_const", const="eager",
                      help="time eager launches with triton.testing.do_bench")
    parser.set_defaults(mode="graph")
    parser.add_argument("--dtype", default="bf16",
                        help="bf16 | fp16 | fp32 (or bfloat16, float16, float32)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_NAMES,
                        help="the cache's element type: auto (--dtype) or fp8 (float8_e4m3fn; "
                             "backends that cannot read it are skipped)")
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--device", default=None, help="cuda | cuda:N | cpu (default: cuda if "
                                                       "available)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed rounds of graph replays (per-call samples on the CPU)")
    parser.add_argument("--calls-per-graph", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help=f"directory for {JSON_NAME} and {PLOT_NAME}")
    parser.add_argument("--ragged", action="store_true",
                        help="also time each cell with its request lengths drawn from "
                             "q_len..kv_len (a ragged batch beside the uniform one)")
    parser.add_argument("--replay", default=None, metavar="PATH",
                        help="time the decode steps a server recorded (`mlaserve serve "
                             "--record-decode-steps PATH`) instead of a grid: each step's own "
                             "lengths, at the first of --heads and --block-sizes; reports each "
                             "backend's time-weighted ratio to the best peer")
    parser.add_argument("--replay-steps", type=int, default=24,
                        help="steps of --replay timed, evenly spaced over the record")
    parser.add_argument("--replay-graph-len", type=positive_int, default=None, metavar="N",
                        help="steps recorded without their plan (older records) are planned as "
                             "the server's decode graphs covering N tokens would plan them "
                             "(its --max-seq-len-to-capture, 8192 by default); steps that "
                             "carry their plan always replay it")
    parser.add_argument("--sweep", default=None,
                        help="variants of the triton backend's plan, timed beside it: groups of "
                             "field=v1,v2 (an MLADecodeConfig field or num_splits), e.g. "
                             "'block_n=32,64 num_stages=2,3'; the product is swept")


def grid_cells(args: argparse.Namespace) -> list[Cell]:
    """The cells the flags ask for."""
    given = [f"--{name.replace('_', '-')}" for name in GRID_FLAGS
             if getattr(args, name) is not None]
    if getattr(args, "replay", None):
        return replay_cells(read_decode_steps(args.replay), (args.heads or [16])[0],
                            (args.block_sizes or GRID_DEFAULTS["block_sizes"])[0],
                            args.replay_steps, args.replay_graph_len)
    if args.grid in PRESETS:
        if given:
            raise ValueError(f"--grid {args.grid} fixes the cells; drop {' '.join(given)}")
        return PRESETS[args.grid]()
    values = {name: getattr(args, name) or GRID_DEFAULTS[name] for name in GRID_FLAGS}
    return flag_cells(**values)


def with_ragged(cells: list[Cell]) -> list[Cell]:
    """The cells and, beside each, its ragged twin (lengths drawn from q_len..kv_len)."""
    twins = [dataclasses.replace(cell, ragged=True) for cell in cells]
    return sorted(set(cells) | set(twins), key=Cell.sort_key)


def backend_names(spec: str | None) -> list[str]:
    """Backend names from --backends (validated), or the defaults."""
    if spec is None:
        return list(DEFAULT_BACKENDS)
    names = []
    for raw in spec.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        name = registry.resolve_backend_name(name, peers=True)
        if name == "auto":
            raise ValueError("--backends takes backend names, not 'auto'")
        names.append(name)
    if not names:
        raise ValueError("--backends is empty")
    return list(dict.fromkeys(names))


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command_line() -> str:
    """The command as typed: `python3 -m mlaserve ...` when started as a module."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "mlaserve":
        argv[:1] = ["python3", "-m", "mlaserve"]
    return shlex.join(argv)


class _GateError(RuntimeError):
    pass


def _one_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


class Sweep:
    """One run of the sweep: its settings, the ceilings, and the per-backend work."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.device = device
        self.dtype = parse_dtype(args.dtype)
        self.cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.kv_lora_rank = args.kv_lora_rank
        self.rope_dim = args.rope_dim
        self.softmax_scale = (QK_NOPE_HEAD_DIM + args.rope_dim) ** -0.5
        self.repeats = args.repeats
        self.calls_per_graph = args.calls_per_graph
        self.on_gpu = device.type == "cuda"
        self.mode = args.mode if self.on_gpu else "cpu"
        self.notes: list[str] = []
        self.ceilings: Ceilings | None = None

    def shape(self, cell: Cell) -> MLAShape:
        return MLAShape(num_heads=cell.num_heads, kv_lora_rank=self.kv_lora_rank,
                        qk_rope_head_dim=self.rope_dim, block_size=cell.block_size,
                        dtype=self.dtype, device=self.device, max_q_len=cell.q_len,
                        kv_cache_dtype=self.cache_dtype)

    def unsupported(self, name: str, cell: Cell) -> str:
        """Why `name` cannot serve `cell` ("" when it can)."""
        try:
            cls = registry.backend_class(split_variant(name)[0])
        except ImportError as exc:
            return f"cannot be imported: {exc}"
        return "; ".join(cls.supports(self.shape(cell)))

    def cell_result(self, cell: Cell, num_copies: int) -> CellResult:
        element_size = self.cache_dtype.itemsize
        num_bytes = decode_bytes(cell, self.kv_lora_rank, self.rope_dim, element_size)
        flops = decode_flops(cell, self.kv_lora_rank, self.rope_dim)
        floor = None
        if self.ceilings is not None:
            floor = floor_seconds(num_bytes, flops, self.ceilings.copy_bytes_per_s,
                                  self.ceilings.matmul_flops_per_s)
        return CellResult(cell, num_bytes, flops, floor, num_copies)

    def bench(self, name: str, cell: Cell, inputs: CellInputs) -> BackendResult:
        """Gate, then time, one backend (or a `--sweep` variant of triton) on one cell."""
        base, changes = split_variant(name)
        try:
            backend = registry.backend_class(base)(self.shape(cell), self.softmax_scale)
            if changes:
                apply_variant(backend, changes)
        except ImportError as exc:
            return BackendResult(name, "skipped", f"cannot be imported: {exc}")
        except UnsupportedShape as exc:
            return BackendResult(name, "skipped", "; ".join(exc.reasons))
        except Exception as exc:  # a crash is reported as this backend's failure
            return BackendResult(name, "failed", _one_line(exc))
        timing = self.mode
        if timing == "graph" and not backend.capabilities.supports_cuda_graphs:
            timing = "eager"
        result = BackendResult(name, "failed", timing=timing)
        try:
            backend.plan(inputs.block_table, inputs.seq_lens, cell.q_len)
            result.plan = backend.describe_plan()
            try:
                o, lse = backend.run(inputs.queries[0], inputs.caches[0], return_lse=True)
            except NotImplementedError:  # a kernel that returns no LSE: check o alone
                o, lse = backend.run(inputs.queries[0], inputs.caches[0]), None
            gate = compare(o, lse, inputs.ref_o, inputs.ref_lse, self.dtype)
            result.gate = gate.metrics
            if not gate.passed:
                result.reason = f"gate: {gate.message}"
                return result
            del o, lse
            result.seconds = self._time(backend, cell, inputs, timing)
        except _GateError as exc:
            result.reason = f"gate under graph replay: {exc}"
            return result
        except Exception as exc:  # a crash is reported as this backend's failure
            result.reason = _one_line(exc)
            return result
        result.status = "ok"
        return result

    def _time(self, backend: MLABackend, cell: Cell, inputs: CellInputs, timing: str) -> float:
        if timing == "cpu":
            return time_cpu(backend, inputs, cell.q_len, self.repeats)
        if timing == "eager":
            return time_eager(backend, inputs, cell.q_len, self.repeats)

        def check(o: torch.Tensor) -> None:
            gate = compare(o, None, inputs.ref_o, inputs.ref_lse, self.dtype)
            if not gate.passed:
                raise _GateError(gate.message)

        return time_graph(backend, inputs, cell.q_len, self.repeats, check,
                          calls_per_graph=self.calls_per_graph, plan_len=cell.plan_len)

    def header(self, args: argparse.Namespace) -> dict[str, Any]:
        """The JSON record's run-wide fields."""
        device: dict[str, Any] = {"type": self.device.type, "name": platform.processor() or "cpu"}
        if self.on_gpu:
            props = torch.cuda.get_device_properties(self.device)
            device = {"type": "cuda", "name": props.name,
                      "capability": list(torch.cuda.get_device_capability(self.device)),
                      "num_sms": props.multi_processor_count}
        ceilings = None
        if self.ceilings is not None:
            ceilings = {"copy_gbps": self.ceilings.copy_bytes_per_s / 1e9,
                        "matmul_tflops": self.ceilings.matmul_flops_per_s / 1e12,
                        "copy": "device-to-device copy of 1 GiB, bytes read + written",
                        "matmul": "bfloat16 8192^3 torch.mm on random data"}
        return {
            "benchmark": "mla_decode",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": _command_line(),
            "args": {k: v for k, v in vars(args).items()
                     if isinstance(v, (str, int, float, bool, list, type(None)))},
            "device": device,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "cuda": torch.version.cuda, "triton": _version("triton"),
                         "flashinfer": _version("flashinfer-python"),
                         "mlaserve": mlaserve.__version__},
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.cache_dtype).removeprefix("torch."),
            "kv_lora_rank": self.kv_lora_rank,
            "rope_dim": self.rope_dim,
            "softmax_scale": self.softmax_scale,
            "timing": self.mode,
            "calls_per_graph": self.calls_per_graph if self.mode == "graph" else None,
            "repeats": self.repeats,
            "peers": list(PEER_BACKENDS),
            "ceilings": ceilings,
            "notes": self.notes,
        }


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("CUDA is not available here; use --device cpu")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device {name}: cuda or cpu only")
    return device


def _progress(index: int, total: int, cell_result: CellResult) -> str:
    parts = []
    for r in cell_result.results:
        us = cell_result.metrics(r)["time_us"]
        parts.append(f"{r.backend} {us:.1f} µs" if us is not None else f"{r.backend} {r.status}")
    floor = f"floor {cell_result.floor_s * 1e6:.1f} µs, " if cell_result.floor_s else ""
    plans = [f"\n    {r.backend} runs {r.plan}" for r in cell_result.results
             if r.plan and r.plan != r.backend]
    return (f"[{index}/{total}] {cell_result.cell.label} ({floor}{cell_result.num_copies} "
            f"KV cop{'y' if cell_result.num_copies == 1 else 'ies'}): " + ", ".join(parts)
            + "".join(plans))


def replay_summary(cell_results: list[CellResult], path: str) -> str:
    """Each backend's time-weighted speed against the best peer over the replayed steps:
    sum(best peer's time) / sum(its time), over the steps where both ran."""
    lines = [f"replay of {path}, {len(cell_results)} steps, time-weighted speed vs the best "
             "peer (above 1: faster):"]
    backends = dict.fromkeys(r.backend for c in cell_results for r in c.results)
    for backend in backends:
        own = peer = 0.0
        for cell_result in cell_results:
            best = cell_result.best_peer_s()
            result = next(r for r in cell_result.results if r.backend == backend)
            if best and result.status == "ok" and result.seconds:
                own, peer = own + result.seconds, peer + best
        lines.append(f"  {backend}: {peer / own:.3f}" if own else f"  {backend}: n/a")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the sweep; 0 when every gated backend passed, 1 when one failed."""
    device = _resolve_device(args.device)
    if args.kv_lora_rank <= 0 or args.rope_dim <= 0 or args.repeats <= 0 \
            or args.calls_per_graph <= 0:
        raise ValueError("--kv-lora-rank, --rope-dim, --repeats and --calls-per-graph must be "
                         "positive")
    cells = grid_cells(args)
    if args.ragged:
        cells = with_ragged(cells)
    names = backend_names(args.backends)
    if args.sweep is not None:
        if SWEPT_BACKEND not in names:
            raise ValueError(f"--sweep varies the {SWEPT_BACKEND} backend: add it to --backends")
        names += [variant_name(changes) for changes in parse_sweep(args.sweep)]
    sweep = Sweep(args, device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    elif device.type == "cpu":
        sweep.notes.append("no CUDA: times are time.perf_counter wall clock on the CPU; graph "
                           "mode, KV-copy rotation and the copy/matmul ceilings (so the floor) "
                           "are skipped")
    if args.backends is None:  # defaults: keep those that can serve some cell here
        kept = []
        for name in names:
            reasons = [sweep.unsupported(name, cell) for cell in cells]
            if all(reasons):
                sweep.notes.append(f"{name} left out: {reasons[0]}")
            else:
                kept.append(name)
        names = kept
    if sweep.on_gpu:
        sweep.ceilings = measure_ceilings(device)
    print(f"mla decode sweep: {len(cells)} cells x {names} on "
          f"{torch.cuda.get_device_name(device) if sweep.on_gpu else 'cpu'}, "
          f"{args.dtype}, timing: {sweep.mode}")
    if sweep.ceilings is not None:
        print(f"ceilings: copy {sweep.ceilings.copy_bytes_per_s / 1e9:.0f} GB/s, bf16 matmul "
              f"{sweep.ceilings.matmul_flops_per_s / 1e12:.0f} TFLOP/s")
    for note in sweep.notes:
        print(f"note: {note}")
    out = None if args.out is None else Path(args.out)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    header = sweep.header(args)
    element_size = sweep.cache_dtype.itemsize
    cell_results: list[CellResult] = []
    for index, cell in enumerate(cells, 1):
        num_copies = copies_needed(cell, args.kv_lora_rank, args.rope_dim, element_size, device)
        inputs = make_inputs(cell, args.kv_lora_rank, args.rope_dim, sweep.dtype, device,
                             sweep.softmax_scale, num_copies, seed=args.seed + index,
                             kv_cache_dtype=sweep.cache_dtype)
        cell_result = sweep.cell_result(cell, num_copies)
        for name in names:
            cell_result.results.append(sweep.bench(name, cell, inputs))
        del inputs
        if sweep.on_gpu:
            torch.cuda.empty_cache()
        cell_results.append(cell_result)
        print(_progress(index, len(cells), cell_result), flush=True)
        if out is not None:  # rewritten after every cell, so a cut-off run keeps its numbers
            header["complete"] = index == len(cells)
            write_json(out / JSON_NAME, to_json(cell_results, header))
    print()
    print(format_table(cell_results))
    if args.replay:
        print(replay_summary(cell_results, args.replay))
    if out is not None:
        print(f"wrote {out / JSON_NAME}")
        try:
            title = (f"MLA decode, {args.dtype}, {sweep.mode} timing, "
                     f"{header['device']['name']}")
            plot_bandwidth(out / PLOT_NAME, cell_results, title,
                           sweep.ceilings.copy_bytes_per_s if sweep.ceilings else None)
            print(f"wrote {out / PLOT_NAME}")
        except ImportError:
            print("matplotlib is not installed: no plot")
    failed = [f"{r.backend} on {c.cell.label}" for c in cell_results for r in c.results
              if r.status == "failed"]
    if failed:
        print(f"gate or run failures (not timed): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
