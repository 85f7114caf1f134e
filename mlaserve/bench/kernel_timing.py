"""Timing of one backend on one cell, through the shared timers of `mlaserve.kernels.testing`.

- Graph (default on CUDA): the backend's CUDA-graph hooks (`init_graph_buffers`,
  `plan_for_capture`, `plan_for_replay`) around `testing.graph_replay_seconds`: graphs of
  `calls_per_graph` calls (16 by default) until every KV copy is used, one timed round replays
  them all; time per call = round time / calls, the median of the rounds.
- Eager on CUDA: `testing.eager_seconds` (do_bench) over calls that rotate the KV copies.
- CPU: `testing.cpu_seconds` (time.perf_counter, for tests on tiny shapes).
"""

from collections.abc import Callable

import torch

from mlaserve.attention.base import MLABackend
from mlaserve.bench.kernel_cases import CellInputs
from mlaserve.kernels.testing import (
    cpu_seconds,
    eager_seconds,
    graph_replay_seconds,
    rotating,
)


def _calls(backend: MLABackend, inputs: CellInputs) -> list[Callable[[], torch.Tensor]]:
    """One call per KV copy: o [B * q_len, H, L] of the planned batch on that copy."""
    return [lambda i=i: backend.run(inputs.queries[i], inputs.caches[i])
            for i in range(inputs.num_copies)]


def time_eager(backend: MLABackend, inputs: CellInputs, q_len: int, repeats: int) -> float:
    """Median seconds per eager call on CUDA, KV copies rotated."""
    backend.plan(inputs.block_table, inputs.seq_lens, q_len)
    return eager_seconds(rotating(_calls(backend, inputs)), repeats)


def time_cpu(backend: MLABackend, inputs: CellInputs, q_len: int, repeats: int) -> float:
    """Median wall-clock seconds per call, after one warm-up call."""
    backend.plan(inputs.block_table, inputs.seq_lens, q_len)
    return cpu_seconds(rotating(_calls(backend, inputs)), repeats)


def time_graph(backend: MLABackend, inputs: CellInputs, q_len: int, repeats: int,
               check: Callable[[torch.Tensor], None], calls_per_graph: int = 16,
               warmup_rounds: int = 2, plan_len: int | None = None) -> float:
    """Median seconds per call under CUDA-graph replay, through the backend's graph hooks.

    `check` gets the replayed output of a call on copy 0 ([B * q_len, H, L]) after the first
    round, before any timing; it raises if the output is wrong. plan_len: the length the
    graphs' block table covers, as a server's decode graphs cover `--max-seq-len-to-capture`
    (the bound the backends plan for); None: the inputs' own table.
    """
    batch, width = inputs.block_table.shape
    if plan_len is not None:
        width = max(width, -(-plan_len // inputs.caches[0].shape[1]))
    backend.init_graph_buffers(batch, width)
    backend.plan_for_capture(batch, q_len)
    return graph_replay_seconds(
        _calls(backend, inputs), repeats, check=check, calls_per_graph=calls_per_graph,
        warmup_rounds=warmup_rounds,
        after_capture=lambda: backend.plan_for_replay(inputs.block_table, inputs.seq_lens, q_len))
