"""CUDA graphs of one prompt's prefill: the step that gives one user a first token.

A step that prefills one prompt chunk with no cached context before it and decodes nothing
(the usual step at one user, when a request arrives) runs the whole model eagerly: several
hundred launches, each a few microseconds of host time, while the GPU works a fraction of that
for a short prompt. These graphs run that forward in one replay. One graph per padded chunk
length (`TOKEN_SIZES` up to the step's token budget); a chunk of n tokens replays the smallest
of >= n. Rows past n are padding: token 0 at the positions after the chunk's, writing their
latents into the scratch slot; causal attention keeps them out of the real rows' outputs.

Static state the graphs read: the rows' input ids and cache slots [T], filled before each
replay, and their positions 0 .. T - 1, fixed. The step's sampling, verification and drafting
then read the real rows of the static output as they read an eager forward's.
"""

import bisect

import torch

from mlaserve.attention.base import MLABackend
from mlaserve.attention.metadata import AttentionMetadata, PrefillChunk
from mlaserve.engine.cuda_graphs import GraphLadder
from mlaserve.model.deepseek import DeepseekForCausalLM

TOKEN_SIZES = (16, 32, 64, 128, 256, 512)  # padded chunk lengths captured


class PrefillGraphs(GraphLadder):
    """Captured forwards of one prompt chunk without cached context, by padded length."""

    what = "prefill"

    def __init__(self, model: DeepseekForCausalLM, kv_caches: list[torch.Tensor],
                 backend: MLABackend, max_tokens: int, max_blocks_per_seq: int,
                 scratch_slot: int, pool: object | None = None) -> None:
        """
        Args:
            kv_caches: the per-layer caches the forward writes.
            max_tokens: the longest chunk captured (the step's token budget, max_model_len):
                lengths of `TOKEN_SIZES` up to it.
            scratch_slot: the cache slot padded rows write.
            pool: a memory pool to share (the decode graphs').
        """
        self.kv_caches = kv_caches
        lengths = tuple(t for t in TOKEN_SIZES if t <= max_tokens)
        if not lengths:
            raise ValueError(f"no prefill graph fits {max_tokens} tokens")
        self.slots = torch.full((lengths[-1],), scratch_slot, dtype=torch.int64,
                                device=kv_caches[0].device)
        super().__init__(model, backend, [1], lengths, max_blocks_per_seq, scratch_slot,
                         kv_caches[0].device, pool)
        # a chunk with no cached context sits at positions 0 .. n - 1: fixed once
        self.positions.copy_(torch.arange(self.positions.shape[0], device=self.positions.device))

    def _plan_capture(self, batch_size: int, q_len: int) -> None:
        pass  # no decode rows: the decode backend is not used

    def _forward(self, batch_size: int, q_len: int) -> torch.Tensor:
        """The final hidden states [T, D] of one chunk of T = q_len rows."""
        meta = AttentionMetadata(slot_mapping=self.slots[:q_len], num_decode_tokens=0,
                                 prefills=[PrefillChunk(0, q_len, 0, None)])
        return self.model(self.input_ids[:q_len], self.positions[:q_len], self.kv_caches, meta)

    def length_for_step(self, chunks: list[PrefillChunk]) -> int | None:
        """The captured length that runs a step of these chunks and no decodes: one chunk
        with no cached context, of at most the longest length; else None (eager)."""
        if len(chunks) != 1 or chunks[0].context_len:
            return None
        at = bisect.bisect_left(self.q_lens, chunks[0].num_tokens)
        return self.q_lens[at] if at < len(self.q_lens) else None

    def run(self, input_ids: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
        """Replay the forward of one chunk of n <= length tokens.

        Args:
            input_ids, slots: [n] int64 on the device, the chunk's rows (at positions
                0 .. n - 1: no cached context), as an eager step's.
            length: the captured length to replay (`length_for_step`).

        Returns:
            The final hidden states [n, D] (a view of the static output, valid until the next
            replay).
        """
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:length].zero_()
        self.slots[:n].copy_(slots)
        self.slots[n:length].fill_(self.scratch_slot)
        self.graphs[length, 1].replay()
        self.num_replays += 1
        return self.outputs[length, 1][:n]
