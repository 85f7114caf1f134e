"""CUDA graphs of the decode-only forward pass, one per padded batch size.

A decode step of n requests launches a few thousand small kernels; replaying a captured graph
launches them in one call, and the host (and its GIL) is free during the whole forward. Graphs
are captured at start-up for the batch sizes 1, 2, 4, 8, 16, 24, ... up to `max_num_seqs`
(vLLM's ladder); a step of n requests replays the smallest graph of >= n rows.

Static state the graphs read, refilled before each replay:
- input ids and positions [max_batch] (rows past n: stale ids and positions);
- the attention backend's static block table and lengths (`plan_for_replay`; rows past n get
  length 0 and attend nothing).
A decode graph computes each row's cache slot itself from those (`cache_slots`; a row of a
request of length 0, a padded one, gets the slot of a scratch cache row that no request owns,
so padded rows write nowhere that matters) into its static slots, which the drafting graph
after it reads too.
Steps with prefill chunks, more than the largest graph's requests, or a block table wider than
`max_seq_len_to_capture` allows run eagerly.

A speculating engine also captures each size with q_len = k + 1 rows per request (its drafts'
verification, the decode kernels' q_len > 1): rows are request-major, so n requests fill the
first n * q_len rows.

Under expert parallelism a graph's MoE exchanges carry its batch size in rows per rank, so a
replica replays the graph whose size is the step's agreed capacity (`Lockstep.agree_capacity`),
and replicas with no batch join the same exchanges eagerly.
"""

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mlaserve.attention.base import MLABackend
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.model.deepseek import DeepseekForCausalLM

logger = logging.getLogger(__name__)
T = TypeVar("T")


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_batch_size."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


def capture(forward: Callable[[], T], pool: object | None) -> tuple[torch.cuda.CUDAGraph, T]:
    """(graph, its static output) of forward(), captured in `pool` (None: a new one) after one
    run outside the capture, on a side stream as torch recommends (compiles and first-call
    initialisation happen there)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return graph, output


def cache_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int
                ) -> torch.Tensor:
    """The latent-cache slot of each row [n * q_len] int64 (request-major rows at `positions`
    [n * q_len] int64) from the requests' block table [n, width] int32."""
    num_requests = block_table.shape[0]
    blocks = block_table.gather(1, positions.view(num_requests, -1) // block_size)  # [n, q_len]
    return blocks.view(-1).long() * block_size + positions % block_size


class GraphLadder:
    """Captured forwards of one kind, one per (q_len, padded batch size), sharing static inputs
    (token ids and positions [max batch * max q_len]; rows past n * q_len: stale ids and
    positions) and the backend's static block table and lengths (`plan_for_replay`: rows past
    n get length 0). Subclasses set what their forward reads, then call this constructor,
    which captures."""

    what = "decode"  # for the log line

    def __init__(self, model: DeepseekForCausalLM, backend: MLABackend, sizes: list[int],
                 q_lens: tuple[int, ...], max_blocks_per_seq: int, scratch_slot: int,
                 device: torch.device, pool: object | None = None) -> None:
        self.model = model
        self.backend = backend
        self.sizes = sizes  # ascending
        self.q_lens = q_lens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_slot = scratch_slot
        max_rows = sizes[-1] * max(q_lens)
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        # by (q_len, batch size)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], Any] = {}
        self._pool = pool  # the memory pool all graphs share
        self.num_replays = 0
        self._capture_all()

    def _forward(self, batch_size: int, q_len: int) -> Any:
        raise NotImplementedError

    def _plan_capture(self, batch_size: int, q_len: int) -> None:
        """Before capturing (or re-running) the graph of (q_len, batch_size): the decode
        backend planned for its rows."""
        self.backend.plan_for_capture(batch_size, q_len)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        started = time.perf_counter()
        # largest first: later ones reuse its pool
        for q_len in sorted(self.q_lens, reverse=True):
            for batch_size in reversed(self.sizes):
                self._plan_capture(batch_size, q_len)
                key = (q_len, batch_size)
                self.graphs[key], self.outputs[key] = self._record(batch_size, q_len)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        logger.info("captured %d %s CUDA graphs (batch 1..%d, q_len %s, up to %d blocks per "
                    "sequence) in %.1f s", len(self.graphs), self.what, self.sizes[-1],
                    ", ".join(map(str, self.q_lens)), self.max_blocks_per_seq,
                    time.perf_counter() - started)

    def _record(self, batch_size: int, q_len: int) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Capture the forward of batch_size x q_len rows: (graph, its static output)."""
        graph, output = capture(lambda: self._forward(batch_size, q_len), self._pool)
        self._pool = graph.pool()
        return graph, output

    @property
    def pool(self) -> object:
        """The memory pool the graphs share (later captures of the step may share it)."""
        return self._pool

    def covers(self, batch_size: int, table_width: int, q_len: int = 1) -> bool:
        return (q_len in self.q_lens and batch_size <= self.sizes[-1]
                and table_width <= self.max_blocks_per_seq)

    def padded_size(self, batch_size: int) -> int:
        """The captured batch size that runs `batch_size` requests: the smallest one >= it."""
        return self.sizes[bisect.bisect_left(self.sizes, batch_size)]

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor, batch_size: int,
                q_len: int) -> Any:
        """Fill the shared static inputs for block_table's n requests, replay the graph of
        (q_len, batch_size) and return its static output (valid until its next replay)."""
        rows = block_table.shape[0] * q_len
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.backend.plan_for_replay(block_table, seq_lens, q_len,
                                     graph_batch_size=batch_size)  # rows n.. get length 0
        self.graphs[q_len, batch_size].replay()
        self.num_replays += 1
        return self.outputs[q_len, batch_size]


class DecodeGraphs(GraphLadder):
    """Captured decode forwards for a fixed model, caches and backend."""

    def __init__(self, model: DeepseekForCausalLM, kv_caches: list[torch.Tensor],
                 backend: MLABackend, max_batch_size: int, max_blocks_per_seq: int,
                 scratch_slot: int, q_lens: tuple[int, ...] = (1,)) -> None:
        """
        Args:
            kv_caches: the per-layer caches [num_blocks, block_size, L + R].
            max_blocks_per_seq: block-table width the graphs cover.
            scratch_slot: a cache slot no request owns (padded rows write their latents there).
            q_lens: rows per request of the graphs captured (each at every batch size).
        """
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0].shape[1]
        backend.init_graph_buffers(max_batch_size, max_blocks_per_seq)
        max_rows = max_batch_size * max(q_lens)
        self.slots = torch.full((max_rows,), scratch_slot, dtype=torch.int64,
                                device=kv_caches[0].device)  # written by the graphs
        super().__init__(model, backend, capture_sizes(max_batch_size), q_lens,
                         max_blocks_per_seq, scratch_slot, kv_caches[0].device)

    def _forward(self, batch_size: int, q_len: int) -> torch.Tensor:
        rows, backend = batch_size * q_len, self.backend
        positions = self.positions[:rows]
        table = backend.graph_block_table[:batch_size]
        padded = backend.graph_seq_lens[:batch_size] == 0  # [B]
        # a padded row's stale position stays inside the table (its slot is the scratch one)
        in_table = positions.clamp(max=table.shape[1] * self.block_size - 1)
        slots = cache_slots(table, in_table, self.block_size).view(batch_size, q_len)
        self.slots[:rows].copy_(slots.masked_fill(padded[:, None], self.scratch_slot).view(-1))
        meta = AttentionMetadata(slot_mapping=self.slots[:rows], num_decode_tokens=rows,
                                 decode_backend=backend)
        return self.model(self.input_ids[:rows], self.positions[:rows], self.kv_caches, meta)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, batch_size: int | None = None, q_len: int = 1
            ) -> torch.Tensor:
        """Replay the decode forward for n requests of q_len rows each (their cache slots
        computed in the graph, into `slots`).

        Args:
            input_ids, positions: [n * q_len] int64 on the device, request-major.
            block_table: [n, width] int32, width <= max_blocks_per_seq; seq_lens: [n] int32.
            batch_size: the captured size to replay (>= n; under expert parallelism the rows
                every replica exchanges); None: the smallest that holds n.
            q_len: one of the captured `q_lens`.

        Returns:
            The final hidden states [n * q_len, D] (a view of the graph's static output, valid
            until the next replay).
        """
        n = block_table.shape[0]
        batch_size = self.padded_size(n) if batch_size is None else batch_size
        output = self._replay(input_ids, positions, block_table, seq_lens, batch_size, q_len)
        return output[:n * q_len]
