"""CUDA graphs of a step's MTP drafting: all k passes of the module in one graph
(spec_decode.py, `draft`).

A speculating step drafts with k passes of the module: the first over the step's rows (q_len
rows a request: a verification's k + 1), then k - 1 more, one row a drafting request, each on
its previous output and draft at the next position; after each, the LM head's argmax at every
request's last row. A pass is one decoder layer and the vocabulary projection, a few dozen
small kernels; one replay launches all k passes at once, and the host computes nothing
between them.

One graph per decode graph (`cuda_graphs.DecodeGraphs`: its q_lens and batch sizes), captured
after them in their memory pool; a step that replayed the decode graph of (q_len, B) replays
this one of (q_len, B) right after it. Its first pass reads that decode graph's static inputs
and output where they lie: the positions and cache slots, the backend's static block table and
lengths, the main model's hidden states. Besides those it reads the token after each row
[B * q_len] and, per drafting request (padded to B), its last row [B] and that row's position
[B] (-1: a padded row). The recursive passes then compute on the device what the host computes
for an eager pass: each drafting request's block-table row (request = last row // q_len) into
the backend's static block table, and per pass the positions, cache slots (a padded row: the
scratch slot) and lengths (a padded row: 0), set through `MLABackend.set_graph_lengths`. Hence
backends whose graphs read their lengths on the device (`graph_lengths_on_device`) only.

`VerifyDraftGraphs` runs the same passes after a verification of the decode graph's rows,
where the step needs nothing from the host to verify (`spec_graph_step.py`). A step whose
forward ran eagerly (prompt chunks beside its decodes: every step that admits a request) runs
the first pass eagerly over its rows, then replays `RecursiveDraftGraphs`: passes 2..k alone,
from the requests' first drafts, module outputs and positions copied into its static inputs,
and their block-table rows into the backend's static table. After a prefill graph (one prompt
from position 0: prefill_graphs.py) `PrefillDraftGraphs` runs all k passes, the first over the
prompt's rows as a chunk.
"""

import torch

from mlaserve.attention.base import MLABackend
from mlaserve.attention.metadata import AttentionMetadata, PrefillChunk
from mlaserve.engine.cuda_graphs import DecodeGraphs, GraphLadder, cache_slots
from mlaserve.engine.prefill_graphs import PrefillGraphs
from mlaserve.engine.rejection_sampler import greedy_verify, sampled_verify
from mlaserve.engine.sampler import RowParams, SamplingBatch
from mlaserve.model.deepseek import DeepseekForCausalLM


class _MTPLadder(GraphLadder):
    """Captured MTP drafting passes: the recursive passes' body, which every kind shares."""

    def __init__(self, model: DeepseekForCausalLM, mtp_cache: torch.Tensor,
                 backend: MLABackend, num_speculative_tokens: int, block_size: int,
                 sizes: list[int], q_lens: tuple[int, ...], like: GraphLadder) -> None:
        """Capture the subclass's graphs (its static inputs set first) for these sizes and
        q_lens, with the table width, scratch slot and memory pool of the graphs they follow
        (`like`)."""
        self.mtp_cache = mtp_cache
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        super().__init__(model, backend, sizes, q_lens, like.max_blocks_per_seq,
                         like.scratch_slot, mtp_cache.device, like.pool)

    def _recursive(self, batch_size: int, token: torch.Tensor, previous: torch.Tensor,
                   last_positions: torch.Tensor, table_rows: torch.Tensor | None = None
                   ) -> list[torch.Tensor]:
        """Passes 2..k over B drafting requests, a row each, on the device alone: drafts 2..k,
        [B] int64 each.

        Args:
            token: [B] int64, each request's first draft; previous: [B, D], the module's
                output at its last row; last_positions: [B] int64, that row's position (-1: a
                padded request).
            table_rows: [B] int64, each request's row in the backend's static block table,
                copied into its first B rows; None: they are there already.
        """
        if self.num_speculative_tokens == 1:
            return []
        backend = self.backend
        backend.plan_for_capture(batch_size, 1)
        table = backend.graph_block_table[:batch_size]  # [B, max_blocks] int32
        if table_rows is not None:
            table.copy_(backend.graph_block_table[table_rows])
        valid = last_positions >= 0
        drafts = []
        for ahead in range(1, self.num_speculative_tokens):
            positions = (last_positions + ahead).clamp(min=0)  # [B]
            backend.set_graph_lengths(torch.where(valid, positions + 1, 0).to(torch.int32))
            slots = torch.where(valid, cache_slots(table, positions, self.block_size),
                                self.scratch_slot)
            meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch_size,
                                     decode_backend=backend)
            previous = self.model.mtp(token, positions, previous, self.mtp_cache, meta)
            token = self.model.compute_logits(previous).argmax(dim=-1)
            drafts.append(token)
        return drafts


class RecursiveDraftGraphs(_MTPLadder):
    """Captured recursive passes (2..k) alone, for the steps whose forward ran eagerly (prompt
    chunks beside the decodes, or a decode no graph covers): the first pass runs eagerly over
    the step's rows, then one replay drafts the rest. One graph per decode-graph batch size;
    the requests' block-table rows are copied into the backend's static table first."""

    what = "MTP recursive drafting"

    def __init__(self, model: DeepseekForCausalLM, mtp_cache: torch.Tensor, backend: MLABackend,
                 decode: DecodeGraphs, num_speculative_tokens: int, block_size: int) -> None:
        """As `DraftGraphs` (k > 1); captured in the decode graphs' memory pool."""
        device, largest = mtp_cache.device, decode.sizes[-1]
        hidden = next(iter(decode.outputs.values()))  # the main model's hidden states [B, D]
        self.token = torch.zeros(largest, dtype=torch.int64, device=device)
        self.previous = torch.zeros(largest, hidden.shape[-1], dtype=hidden.dtype, device=device)
        self.last_positions = torch.full((largest,), -1, dtype=torch.int64, device=device)
        super().__init__(model, mtp_cache, backend, num_speculative_tokens, block_size,
                         decode.sizes, (1,), decode)

    def _forward(self, batch_size: int, q_len: int) -> torch.Tensor:
        """Drafts 2..k [B, k - 1] int64 (rows past the step's: junk)."""
        return torch.stack(self._recursive(batch_size, self.token[:batch_size],
                                           self.previous[:batch_size],
                                           self.last_positions[:batch_size]), dim=1)

    def run(self, token: torch.Tensor, previous: torch.Tensor, last_positions: torch.Tensor,
            block_table: torch.Tensor) -> torch.Tensor:
        """Passes 2..k of S drafting requests after an eager first pass (as `_recursive`, with
        their block table [S, width] int32, width <= the graphs'): drafts [S, k - 1] int64 (a
        copy)."""
        count, width = block_table.shape
        batch_size = self.padded_size(count)
        self.token[:count].copy_(token)
        self.previous[:count].copy_(previous)
        self.last_positions[:count].copy_(last_positions)
        self.last_positions[count:batch_size].fill_(-1)
        self.backend.graph_block_table[:count, :width].copy_(block_table)
        self.graphs[1, batch_size].replay()
        self.num_replays += 1
        return self.outputs[1, batch_size][:count].clone()


class PrefillDraftGraphs(_MTPLadder):
    """All k passes after a prefill graph's replay (one prompt from position 0,
    `prefill_graphs.PrefillGraphs`): the first over its T rows as a prompt chunk, reading that
    graph's static positions, slots and output, then passes 2..k from the prompt's last row.
    One graph per prefill length; the request's block-table row is copied into the backend's
    static table first."""

    what = "MTP drafting after a prefill"

    def __init__(self, model: DeepseekForCausalLM, mtp_cache: torch.Tensor, backend: MLABackend,
                 prefill: PrefillGraphs, num_speculative_tokens: int, block_size: int
                 ) -> None:
        """As `DraftGraphs`, after the prefill graphs (in their memory pool)."""
        device = mtp_cache.device
        self.prefill = prefill
        self.last = torch.zeros(1, dtype=torch.int64, device=device)
        self.last_positions = torch.full((1,), -1, dtype=torch.int64, device=device)
        super().__init__(model, mtp_cache, backend, num_speculative_tokens, block_size, [1],
                         prefill.q_lens, prefill)

    def _plan_capture(self, batch_size: int, q_len: int) -> None:
        pass  # the first pass decodes nothing; the recursive passes plan their own rows

    def _forward(self, batch_size: int, q_len: int) -> torch.Tensor:
        """The drafts [1, k] int64 of the prompt's request (junk if it does not draft)."""
        prefill = self.prefill
        meta = AttentionMetadata(slot_mapping=prefill.slots[:q_len], num_decode_tokens=0,
                                 prefills=[PrefillChunk(0, q_len, 0, None)])
        out = self.model.mtp(self.input_ids[:q_len], prefill.positions[:q_len],
                             prefill.outputs[q_len, 1], self.mtp_cache, meta)
        previous = out[self.last]  # [1, D]
        token = self.model.compute_logits(previous).argmax(dim=-1)  # [1]
        return torch.stack([token, *self._recursive(1, token, previous, self.last_positions)],
                           dim=1)

    def run(self, next_ids: torch.Tensor, last: torch.Tensor, last_positions: torch.Tensor,
            block_table: torch.Tensor | None, length: int) -> torch.Tensor:
        """Right after the prefill graph of `length` replayed the step's n rows: the MTP
        module's passes, given the token after each row [n] int64 and, for a drafting request
        (S = 1, or 0 when the prompt's chunk does not sample), its last row and position [S]
        int64 and block table [S, width] int32 (None when S = 0). Returns its drafts [S, k]
        int64 (a copy)."""
        n, drafting = next_ids.shape[0], last.shape[0]
        self.input_ids[:n].copy_(next_ids)
        self.input_ids[n:length].zero_()
        if drafting:
            self.last.copy_(last)
            self.last_positions.copy_(last_positions)
            self.backend.graph_block_table[:1, :block_table.shape[1]].copy_(block_table)
        else:  # the cache of the prompt's positions filled; nothing drafts
            self.last.zero_()
            self.last_positions.fill_(-1)
        self.graphs[length, 1].replay()
        self.num_replays += 1
        return self.outputs[length, 1][:drafting].clone()


class DraftGraphs(_MTPLadder):
    """Captured MTP drafting (k passes) for a fixed model, MTP cache, backend and decode
    graphs."""

    what = "MTP drafting"

    def __init__(self, model: DeepseekForCausalLM, mtp_cache: torch.Tensor, backend: MLABackend,
                 decode: DecodeGraphs, num_speculative_tokens: int, block_size: int,
                 q_lens: tuple[int, ...] | None = None, max_batch_size: int | None = None,
                 recursive: RecursiveDraftGraphs | None = None,
                 after_prefill: PrefillDraftGraphs | None = None) -> None:
        """
        Args:
            decode: the decode graphs whose replays these follow (their static inputs, outputs
                and memory pool; by default their q_lens and batch sizes).
            block_size: tokens per cache block.
            q_lens, max_batch_size: capture only these q_lens, and sizes up to this one.
            recursive: the recursive passes alone, for the steps no decode graph ran (k > 1).
            after_prefill: all k passes after a prefill graph's replay.
        """
        device = mtp_cache.device
        self.decode = decode
        self.recursive = recursive
        self.after_prefill = after_prefill
        sizes = [s for s in decode.sizes if max_batch_size is None or s <= max_batch_size]
        self.last = torch.zeros(sizes[-1], dtype=torch.int64, device=device)
        self.last_positions = torch.full((sizes[-1],), -1, dtype=torch.int64, device=device)
        super().__init__(model, mtp_cache, backend, num_speculative_tokens, block_size, sizes,
                         q_lens or decode.q_lens, decode)

    def _forward(self, batch_size: int, q_len: int) -> torch.Tensor:
        """The drafts [B, k] int64 of the B drafting requests (rows past the step's: junk)."""
        return self._draft(batch_size, q_len, self.input_ids[:batch_size * q_len],
                           self.last[:batch_size], self.last_positions[:batch_size])

    def _draft(self, batch_size: int, q_len: int, next_ids: torch.Tensor, last: torch.Tensor,
               last_positions: torch.Tensor) -> torch.Tensor:
        """The k passes over the decode graph's B x q_len rows: drafts [B, k] int64, given the
        token after each row [B * q_len], each drafting request's last row [B] and its
        position [B] (-1: a padded request)."""
        rows, decode, backend = batch_size * q_len, self.decode, self.backend
        backend.plan_for_capture(batch_size, q_len)  # the recursive passes re-plan
        meta = AttentionMetadata(slot_mapping=decode.slots[:rows], num_decode_tokens=rows,
                                 decode_backend=backend)
        out = self.model.mtp(next_ids, decode.positions[:rows],
                             decode.outputs[q_len, batch_size], self.mtp_cache, meta)
        previous = out[last]  # [B, D]
        token = self.model.compute_logits(previous).argmax(dim=-1)  # [B]
        drafts = [token, *self._recursive(batch_size, token, previous, last_positions,
                                          last // q_len)]
        return torch.stack(drafts, dim=1)

    def run(self, next_ids: torch.Tensor, last: torch.Tensor, last_positions: torch.Tensor,
            q_len: int, batch_size: int) -> torch.Tensor:
        """All k passes, right after the decode graph of (q_len, batch_size) replayed the step.

        Args:
            next_ids: [n * q_len] int64, the token after each of the step's rows.
            last: [S] int64, S <= n, each drafting request's last computed row;
                last_positions: [S] int64, its position.

        Returns:
            The drafts [S, k] int64 (a copy).
        """
        num_samplers = last.shape[0]
        self.input_ids[:next_ids.shape[0]].copy_(next_ids)
        self.last[:num_samplers].copy_(last)
        self.last[num_samplers:batch_size].zero_()  # in range of any graph's rows
        self.last_positions[:num_samplers].copy_(last_positions)
        self.last_positions[num_samplers:batch_size].fill_(-1)
        self.graphs[q_len, batch_size].replay()
        self.num_replays += 1
        return self.outputs[q_len, batch_size][:num_samplers].clone()


class VerifyDraftGraphs(DraftGraphs):
    """A speculating step's whole sampling in one graph, for the steps where every request
    verifies all k drafts against the model's logits as they come (`spec_graph_step`): after
    the decode graph of q_len k + 1, the logits at every row, the drafts (the decode graph's
    input ids past each request's first row) checked against them, then the k drafting passes
    from the rows and positions that gives. The check is one of three, a set of graphs each
    (`kind`): "greedy" (`greedy_verify` on the argmax), "sampled" and "filtered" (top-k, top-p
    or min-p): `sampled_verify` with each request's parameters and seed, read from the
    persistent batch at its row (`rows`, copied over per step). Captured up to `max_batch_size`
    requests: the logits (and, sampled, the distributions and noise) of all their rows live in
    the graphs' pool, and a larger step's GPU time dwarfs the launches this saves."""

    what = "verification and MTP drafting"
    KINDS = {"greedy": 64, "sampled": 16, "filtered": 16}  # kind: largest batch captured

    def __init__(self, model: DeepseekForCausalLM, mtp_cache: torch.Tensor, backend: MLABackend,
                 decode: DecodeGraphs, num_speculative_tokens: int, block_size: int,
                 kind: str = "greedy", params: RowParams | None = None) -> None:
        """As `DraftGraphs`; the graphs follow the decode graphs of q_len k + 1. params: the
        persistent batch's sampling parameters (the sampled kinds)."""
        self.verify_q_len = num_speculative_tokens + 1
        self.kind, self.params = kind, params
        self.rows = torch.zeros(self.KINDS[kind], dtype=torch.int64, device=mtp_cache.device)
        super().__init__(model, mtp_cache, backend, decode, num_speculative_tokens, block_size,
                         (self.verify_q_len,), self.KINDS[kind])

    def _forward(self, batch_size: int, q_len: int) -> torch.Tensor:
        """[B, 2k + 4] int64, per request: the tokens it emits [k + 1] (-1 past its count),
        that count, its k new drafts, its newest token and how many drafts it rejected."""
        rows, decode, k = batch_size * q_len, self.decode, self.num_speculative_tokens
        logits = self.model.compute_logits(decode.outputs[q_len, batch_size])  # [R, V]
        drafts_verified = decode.input_ids[:rows].view(batch_size, q_len)[:, 1:]  # [B, k]
        if self.kind == "greedy":
            tokens, emitted = greedy_verify(logits.argmax(dim=-1).view(batch_size, q_len),
                                            drafts_verified)
        else:  # each row samples the token after its position
            batch = SamplingBatch(self.params, self.rows[:batch_size, None].expand(
                batch_size, q_len).reshape(-1), decode.positions[:rows] + 1,
                all_greedy=False, needs_filter=self.kind == "filtered")
            gather = torch.arange(rows, device=logits.device).view(batch_size, q_len)
            tokens, emitted = sampled_verify(logits, batch, gather, drafts_verified,
                                             torch.full((batch_size,), k, device=logits.device))
        last = torch.arange(batch_size, device=tokens.device) * q_len + emitted - 1  # [B]
        padded = self.backend.graph_seq_lens[:batch_size] == 0  # before the passes set them
        last_positions = decode.positions[:rows][last].masked_fill(padded, -1)
        drafts = self._draft(batch_size, q_len, tokens.clamp(min=0).view(-1), last,
                             last_positions)
        newest = tokens.gather(1, (emitted - 1)[:, None])  # [B, 1]
        return torch.cat([tokens, emitted[:, None], drafts, newest, (k + 1 - emitted)[:, None]],
                         dim=1)

    def run(self, num_requests: int, batch_size: int, rows: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Right after the decode graph of (k + 1, batch_size) replayed the step's
        num_requests verifications: their outcome [n, 2k + 4] int64 (`_forward`; a copy).
        rows: the requests' rows in the persistent batch [n] int64 (the sampled kinds)."""
        if rows is not None:
            self.rows[:num_requests].copy_(rows)
            self.rows[num_requests:batch_size].zero_()
        self.graphs[self.verify_q_len, batch_size].replay()
        self.num_replays += 1
        return self.outputs[self.verify_q_len, batch_size][:num_requests].clone()
