"""Timing of one backend on one cell, and the device ceilings measured in the same run.

- Graph (default on CUDA): the backend's CUDA-graph hooks (`init_graph_buffers`,
  `plan_for_capture`, `plan_for_replay`); each graph captures `calls_per_graph` calls (16 by
  default), graphs are captured until every KV copy is used, and one timed round replays them
  all between two CUDA events. Time per call = round time / calls; the median of the rounds.
- Eager on CUDA: `triton.testing.do_bench` (median, L2 flushed between calls) over calls that
  rotate the KV copies; CUDA events around each call when Triton is missing.
- CPU: `time.perf_counter` around each call, median (for tests on tiny shapes).
Ceilings: a device-to-device copy (bytes read + written per second) and an 8192^3 bfloat16
matmul (flop/s), medians of CUDA-event timings.
"""

import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlaserve.attention.base import MLABackend
from mlaserve.bench.kernel_cases import CellInputs


@dataclass(frozen=True)
class Ceilings:
    """Device rates measured in this run."""

    copy_bytes_per_s: float
    matmul_flops_per_s: float


def _event_median(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() over `repeats` calls, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _copy_seconds(device: torch.device, num_bytes: int, repeats: int) -> float:
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _event_median(lambda: dst.copy_(src), repeats)


def _matmul_seconds(device: torch.device, n: int, repeats: int) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return _event_median(lambda: torch.mm(a, b), repeats)


def measure_ceilings(device: torch.device, copy_bytes: int = 1 << 30, matmul_n: int = 8192,
                     repeats: int = 10) -> Ceilings:
    """Copy bandwidth (read + write) and bfloat16 matmul rate on random data."""
    copy_s = _copy_seconds(device, copy_bytes, repeats)
    matmul_s = _matmul_seconds(device, matmul_n, repeats)
    torch.cuda.empty_cache()
    return Ceilings(2 * copy_bytes / copy_s, 2 * matmul_n**3 / matmul_s)


def _rotating_call(backend: MLABackend, inputs: CellInputs) -> Callable[[], object]:
    copies = itertools.cycle(range(inputs.num_copies))

    def call() -> object:
        index = next(copies)
        return backend.run(inputs.queries[index], inputs.caches[index])

    return call


def time_eager(backend: MLABackend, inputs: CellInputs, q_len: int, repeats: int) -> float:
    """Median seconds per eager call on CUDA (do_bench when Triton is installed)."""
    backend.plan(inputs.block_table, inputs.seq_lens, q_len)
    call = _rotating_call(backend, inputs)
    try:
        from triton.testing import do_bench
    except ImportError:
        return _event_median(call, max(repeats, 1) * 5)
    return do_bench(call, warmup=25, rep=100, return_mode="median") / 1e3


def time_cpu(backend: MLABackend, inputs: CellInputs, q_len: int, repeats: int) -> float:
    """Median wall-clock seconds per call (time.perf_counter), after one warm-up call."""
    backend.plan(inputs.block_table, inputs.seq_lens, q_len)
    call = _rotating_call(backend, inputs)
    call()
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_graph(backend: MLABackend, inputs: CellInputs, q_len: int, repeats: int,
               check: Callable[[torch.Tensor], None], calls_per_graph: int = 16,
               warmup_rounds: int = 2) -> float:
    """Median seconds per call under CUDA-graph replay, through the backend's graph hooks.

    `check` gets the replayed output of a call on copy 0 ([B * q_len, H, L]) after the first
    round, before any timing; it raises if the output is wrong.
    """
    batch, width = inputs.block_table.shape
    backend.init_graph_buffers(batch, width)
    backend.plan_for_capture(batch, q_len)
    # Compile and initialise outside the capture, on a side stream as torch recommends.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.run(inputs.queries[0], inputs.caches[0])
    torch.cuda.current_stream().wait_stream(side)
    num_graphs = math.ceil(inputs.num_copies / calls_per_graph)
    order = [i % inputs.num_copies for i in range(num_graphs * calls_per_graph)]
    graphs, outputs = [], []
    for g in range(num_graphs):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs.append([backend.run(inputs.queries[c], inputs.caches[c])
                            for c in order[g * calls_per_graph:(g + 1) * calls_per_graph]])
        graphs.append(graph)
    backend.plan_for_replay(inputs.block_table, inputs.seq_lens, q_len)

    def round_() -> None:
        for graph in graphs:
            graph.replay()

    round_()
    torch.cuda.synchronize()
    check(outputs[0][0])
    seconds = _event_median(round_, repeats, warmup=warmup_rounds)
    return seconds / (num_graphs * calls_per_graph)
