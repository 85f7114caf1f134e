"""CUDA graphs of the MTP module's drafting passes (spec_decode.py, `draft`).

A speculating step drafts with k passes of the module: the first over the step's rows (q_len
rows a request: a verification's k + 1), then k - 1 more, one row a drafting request, each on
its previous output and draft at the next position; after each, the LM head's argmax at every
request's last row. A pass is one decoder layer and the vocabulary projection, a few dozen
small kernels that a replay launches at once. Graphs are captured per (q_len, padded batch
size) for the decode graphs' q_lens and ladder, after the decode graphs, sharing their memory
pool and the backend's static block table and lengths (`DecodeGraphs` set those up; the passes
replay one after another on one stream).

Static state, refilled before each replay: the tokens, positions, the hidden states the module
reads and the cache slots [max_batch * max q_len] (rows past n * q_len: the scratch slot,
length 0), and each request's last row [max_batch].
"""

import bisect
import logging
import time

import torch

from mlaserve.attention.base import MLABackend
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.engine.cuda_graphs import capture
from mlaserve.model.deepseek import DeepseekForCausalLM

logger = logging.getLogger(__name__)


class DraftGraphs:
    """Captured MTP drafting passes for a fixed model, MTP cache and backend."""

    def __init__(self, model: DeepseekForCausalLM, mtp_cache: torch.Tensor, backend: MLABackend,
                 sizes: list[int], max_blocks_per_seq: int, scratch_slot: int,
                 q_lens: tuple[int, ...] = (1,), pool: object | None = None) -> None:
        """
        Args:
            sizes: the batch sizes to capture, ascending (the decode graphs' `sizes`).
            max_blocks_per_seq: block-table width the graphs cover.
            scratch_slot: a cache slot no request owns.
            q_lens: rows per request of the passes captured (1: the recursive passes).
            pool: the decode graphs' memory pool, shared.
        """
        device = mtp_cache.device
        self.model = model
        self.mtp_cache = mtp_cache
        self.backend = backend
        self.sizes = sizes
        self.q_lens = q_lens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_slot = scratch_slot
        max_batch, max_rows = sizes[-1], sizes[-1] * max(q_lens)
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.slots = torch.full((max_rows,), scratch_slot, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(max_rows, model.config.hidden_size,
                                  dtype=model.lm_head.weight.dtype, device=device)
        self.last = torch.zeros(max_batch, dtype=torch.int64, device=device)
        # by (q_len, batch size)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool = pool
        self.num_replays = 0
        self._capture_all()

    def _forward(self, batch_size: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft tokens [B] int64, the module's outputs at each request's last row [B, D])
        of one pass over B x q_len rows."""
        rows = batch_size * q_len
        meta = AttentionMetadata(slot_mapping=self.slots[:rows], num_decode_tokens=rows,
                                 decode_backend=self.backend)
        out = self.model.mtp(self.input_ids[:rows], self.positions[:rows], self.hidden[:rows],
                             self.mtp_cache, meta)
        last = out[self.last[:batch_size]]
        return self.model.compute_logits(last).argmax(dim=-1), last

    @torch.inference_mode()
    def _capture_all(self) -> None:
        started = time.perf_counter()
        for q_len in sorted(self.q_lens, reverse=True):
            for batch_size in reversed(self.sizes):
                self.backend.plan_for_capture(batch_size, q_len)
                key = (q_len, batch_size)
                self.graphs[key], self.outputs[key] = self._record(batch_size, q_len)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        logger.info("captured %d MTP drafting CUDA graphs in %.1f s", len(self.graphs),
                    time.perf_counter() - started)

    def _record(self, batch_size: int, q_len: int
                ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
        graph, output = capture(lambda: self._forward(batch_size, q_len), self._pool)
        self._pool = graph.pool()
        return graph, output

    def covers(self, batch_size: int, table_width: int, q_len: int = 1) -> bool:
        return (q_len in self.q_lens and batch_size <= self.sizes[-1]
                and table_width <= self.max_blocks_per_seq)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
            slots: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
            last: torch.Tensor | None = None, q_len: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass for n requests of q_len rows each.

        Args:
            tokens, positions, slots: [n * q_len] int64, request-major; hidden: [n * q_len, D]
                what the module reads at each row (the main model's output, or its own last).
            block_table: [n, width] int32, width <= max_blocks_per_seq; seq_lens: [n] int32.
            last: [m] int64, m <= n, the rows whose outputs draft (the drafting requests'
                last rows; None: row i of each of the n requests, q_len 1).

        Returns:
            (draft tokens [m], outputs at the last rows [m, D]): views of the graph's static
            outputs, valid until its next replay.
        """
        n = block_table.shape[0]
        rows = n * q_len
        batch_size = self.sizes[bisect.bisect_left(self.sizes, n)]
        if last is None:
            last = torch.arange(n, device=self.last.device)
        m = last.shape[0]
        self.input_ids[:rows].copy_(tokens)
        self.positions[:rows].copy_(positions)
        self.hidden[:rows].copy_(hidden)
        self.slots[:rows].copy_(slots)
        self.slots[rows:batch_size * q_len].fill_(self.scratch_slot)
        self.last[:m].copy_(last)
        self.last[m:batch_size].zero_()  # in range of any graph's rows
        self.backend.plan_for_replay(block_table, seq_lens, q_len, graph_batch_size=batch_size)
        self.graphs[q_len, batch_size].replay()
        self.num_replays += 1
        token, out = self.outputs[q_len, batch_size]
        return token[:m], out[:m]
