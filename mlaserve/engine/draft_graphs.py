"""CUDA graphs of the MTP module's recursive drafting passes (spec_decode.py, `draft`).

For k > 1 drafts the module runs k - 1 more times a step, one decode row per drafting request:
its previous output and draft at the next position, then the LM head's argmax. Each pass is
one decoder layer and the vocabulary projection, a few dozen small kernels that a replay
launches at once. Graphs are captured per padded batch size (the decode graphs' ladder), after
the decode graphs, sharing their memory pool and the backend's static block table and lengths
(`DecodeGraphs` set those up; the passes replay one after another on one stream).

Static state, refilled before each replay: the draft tokens, positions, the previous hidden
states and cache slots [max_batch] (rows past n: the scratch slot, length 0).
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
    """Captured recursive MTP passes for a fixed model, MTP cache and backend."""

    def __init__(self, model: DeepseekForCausalLM, mtp_cache: torch.Tensor, backend: MLABackend,
                 sizes: list[int], max_blocks_per_seq: int, scratch_slot: int,
                 pool: object | None = None) -> None:
        """
        Args:
            sizes: the batch sizes to capture, ascending (the decode graphs' `sizes`).
            max_blocks_per_seq: block-table width the graphs cover.
            scratch_slot: a cache slot no request owns.
            pool: the decode graphs' memory pool, shared.
        """
        device = mtp_cache.device
        self.model = model
        self.mtp_cache = mtp_cache
        self.backend = backend
        self.sizes = sizes
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_slot = scratch_slot
        max_batch = sizes[-1]
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slots = torch.full((max_batch,), scratch_slot, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(max_batch, model.config.hidden_size,
                                  dtype=model.lm_head.weight.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool = pool
        self.num_replays = 0
        self._capture_all()

    def _forward(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft tokens [B] int64, the module's outputs [B, D]) of one pass."""
        meta = AttentionMetadata(slot_mapping=self.slots[:batch_size],
                                 num_decode_tokens=batch_size, decode_backend=self.backend)
        out = self.model.mtp(self.input_ids[:batch_size], self.positions[:batch_size],
                             self.hidden[:batch_size], self.mtp_cache, meta)
        return self.model.compute_logits(out).argmax(dim=-1), out

    @torch.inference_mode()
    def _capture_all(self) -> None:
        started = time.perf_counter()
        for batch_size in reversed(self.sizes):
            self.backend.plan_for_capture(batch_size)
            self.graphs[batch_size], self.outputs[batch_size] = self._record(batch_size)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        logger.info("captured %d MTP drafting CUDA graphs in %.1f s", len(self.graphs),
                    time.perf_counter() - started)

    def _record(self, batch_size: int
                ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
        graph, output = capture(lambda: self._forward(batch_size), self._pool)
        self._pool = graph.pool()
        return graph, output

    def covers(self, batch_size: int, table_width: int) -> bool:
        return batch_size <= self.sizes[-1] and table_width <= self.max_blocks_per_seq

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor,
            slots: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass for n requests.

        Args:
            tokens, positions, slots: [n] int64; previous: [n, D] the module's last outputs.
            block_table: [n, width] int32, width <= max_blocks_per_seq; seq_lens: [n] int32.

        Returns:
            (draft tokens [n], outputs [n, D]): views of the graph's static outputs, valid
            until its next replay.
        """
        n = tokens.shape[0]
        batch_size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.hidden[:n].copy_(previous)
        self.slots[:n].copy_(slots)
        self.slots[n:batch_size].fill_(self.scratch_slot)
        self.backend.plan_for_replay(block_table, seq_lens, graph_batch_size=batch_size)
        self.graphs[batch_size].replay()
        self.num_replays += 1
        token, out = self.outputs[batch_size]
        return token[:n], out[:n]
