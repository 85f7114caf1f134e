"""CUDA graphs of the MTP module's drafting passes (spec_decode.py, `draft`).

A speculating step drafts with k passes of the module: the first over the step's rows (q_len
rows a request: a verification's k + 1), then k - 1 more, one row a drafting request, each on
its previous output and draft at the next position; after each, the LM head's argmax at every
request's last row. A pass is one decoder layer and the vocabulary projection, a few dozen
small kernels that a replay launches at once. The ladder of graphs (`cuda_graphs.GraphLadder`)
is the decode graphs' q_lens and batch sizes, captured after them in their memory pool, with
the backend's static block table and lengths that they set up (the passes replay one after
another on one stream). Besides the ladder's static inputs a pass reads the hidden states
[max batch * max q_len, D] and each request's last row [max batch].
"""

import torch

from mlaserve.attention.base import MLABackend
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.engine.cuda_graphs import GraphLadder
from mlaserve.model.deepseek import DeepseekForCausalLM


class DraftGraphs(GraphLadder):
    """Captured MTP drafting passes for a fixed model, MTP cache and backend."""

    what = "MTP drafting"

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
        self.mtp_cache = mtp_cache
        self.hidden = torch.zeros(sizes[-1] * max(q_lens), model.config.hidden_size,
                                  dtype=model.lm_head.weight.dtype, device=device)
        self.last = torch.zeros(sizes[-1], dtype=torch.int64, device=device)
        super().__init__(model, backend, sizes, q_lens, max_blocks_per_seq, scratch_slot,
                         device, pool)

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
        batch_size = self.padded_size(n)
        if last is None:
            last = torch.arange(n, device=self.last.device)
        m = last.shape[0]
        self.hidden[:n * q_len].copy_(hidden)
        self.last[:m].copy_(last)
        self.last[m:batch_size].zero_()  # in range of any graph's rows
        token, out = self._replay(tokens, positions, slots, block_table, seq_lens, batch_size,
                                  q_len)
        return token[:m], out[:m]
