"""The runner's side of speculative decoding with the MTP module (speculative.py): verifying a
step's drafts and drafting the next step's.

A verifying request's rows are its next input token at position n, then its d drafts at
n + 1 .. n + d, so the main model's logits at all d + 1 positions come out of the one forward.
Requests verifying all k drafts take k + 1 decode rows each (the decode kernels' q_len > 1, one
plan for the batch), the plain decodes beside them one-token chunks after the prefills; a
request verifying fewer (its drafts cut by max_tokens or the model length) takes a chunk of its
own over the cached context, after those (`speculative_layout`). `verify` turns
those logits into the tokens emitted: the target distribution at each position
(`sampler.target_probs`: the request's penalties, logit bias, min_tokens, temperature and
filters, with the drafts before the position counted as generated: `AheadOfDrafts`), then
`rejection_sampler.rejection_sample` with greedy drafts. Its randomness is a pure function of
(request seed, position), as plain sampling's: the acceptance uniforms from `seeded_uniform` of
a salted seed, the recovery / bonus draw from the plain sampler's own noise at that position.

`draft` then runs the MTP module over every token row of the step, with the token that follows
each row's position (the prompt's next token, the token just sampled, or for a verify chunk the
tokens emitted; past a rejection a filler, whose cache entries the step that computes those
positions writes again) and the main model's hidden state of the row, over the MTP layer's own
latent cache with the step's attention metadata; the MTP logits at each speculating request's
last computed position give its first draft (argmax). For k > 1 the module runs again, a
decode row per request, on its own previous output and draft, at the next positions (their
cache slots are the scheduler's lookahead); where the step replayed a decode or a prefill graph,
one captured graph runs all k passes, and after an eager forward one runs passes 2..k
(draft_graphs.py). Verification and drafting stay on the device: the emitted tokens, their
counts and the drafts reach the host with the step's other copies when it is collected
(`Verification`, `EmittedLogprobs`), so a speculating step is enqueued whole without a host
wait. Steps are pipelined: the next one may be scheduled before this one lands, and then
verifies the drafts this one leaves on the device (`DeviceDrafts`: each drafting request's
newest token, drafts and rejected count); the host counted every draft as accepted, and the
runner moves those requests' positions back by their rejections (`FromDevice`).
"""

from dataclasses import dataclass
from itertools import accumulate

import torch

from mlaserve.attention.metadata import AttentionMetadata, PrefillChunk
from mlaserve.engine.cuda_graphs import cache_slots
from mlaserve.engine.draft_graphs import DraftGraphs
from mlaserve.engine.input_batch import PersistentBatch, RunnerRequest
from mlaserve.engine.rejection_sampler import greedy_verify, sampled_verify
from mlaserve.engine.sampler import processed_logits, top_logprobs
from mlaserve.engine.structured import GrammarBitmask


@dataclass
class Verified:
    """One verifying request's outcome on the host: the tokens emitted (1 .. d + 1) and its d
    drafts."""

    tokens: list[int]
    num_drafts: int


@dataclass
class Verification:
    """A step's verification, left on the device until the step is collected: N verifying
    requests' emitted tokens [N, k + 1] int64 (-1 past each one's count), their counts [N]
    int64, and each one's draft count (host)."""

    tokens: torch.Tensor
    emitted: torch.Tensor
    num_drafts: list[int]

    def to_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Start the copies of tokens and counts to the host (valid once the step's event
        completes)."""
        return (self.tokens.to("cpu", non_blocking=True),
                self.emitted.to("cpu", non_blocking=True))

    @staticmethod
    def outcomes(tokens: torch.Tensor, emitted: torch.Tensor, num_drafts: list[int]
                 ) -> list[Verified]:
        """The host copies of `to_host` as one `Verified` per request."""
        return [Verified(row[:m], d) for row, m, d in zip(tokens.tolist(), emitted.tolist(),
                                                          num_drafts, strict=True)]


@dataclass
class DeviceDrafts:
    """What a speculating launch leaves on the device for the next one, scheduled before it
    lands (pipelined steps): per drafting request (`rows`: its row in these tensors by id),
    its newest token [S] int64 (the next step's input), how many of the drafts it verified
    were rejected [S] int64 (the host counted them as accepted: the next step's positions
    move back by that many) and its k drafts [S, k] int64."""

    rows: dict[str, int]
    last_tokens: torch.Tensor
    rejected: torch.Tensor
    drafts: torch.Tensor

    def take(self, request_ids: list[str], inputs: PersistentBatch
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(newest tokens [n], rejected counts [n], drafts [n, k]) of these requests."""
        missing = [i for i in request_ids if i not in self.rows]
        if missing:
            raise RuntimeError(f"requests {missing} verify drafts that the previous launch did "
                               "not make")
        rows = [self.rows[i] for i in request_ids]
        if rows == list(range(len(self.rows))):  # all of them, in order (always at c = 1)
            return self.last_tokens, self.rejected, self.drafts
        index = inputs.to_device(rows, torch.int64)
        return self.last_tokens[index], self.rejected[index], self.drafts[index]


class AheadOfDrafts:
    """A verifying request as the sampler sees it at a draft position: the drafts before it
    count as generated (penalties, min_tokens), as they will be if accepted; everything else
    is the request's."""

    def __init__(self, request: RunnerRequest, drafts: list[int]) -> None:
        self.request, self.drafts = request, drafts
        # read for every row of every step: plain attributes, not `__getattr__`
        self.params, self.request_id = request.params, request.request_id

    def __getattr__(self, name: str):
        return getattr(self.request, name)

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts

    @property
    def num_output_tokens_total(self) -> int:
        return self.request.num_output_tokens_total + len(self.drafts)

    @property
    def num_total_tokens(self) -> int:
        return self.request.num_total_tokens + len(self.drafts)

    @property
    def num_drafts_ahead(self) -> int:
        return len(self.drafts)


@dataclass
class FromDevice:
    """The verifying requests whose drafts the previous launch left on the device: their
    indices among the step's verifying requests [n] int64 (None: all of them, in order),
    those drafts [n, k] int64 and the corrections of their host positions [N] int64 (for
    every verifying request: how far the previous step's rejections move its positions back;
    0 for the others)."""

    index: torch.Tensor | None
    drafts: torch.Tensor
    corrections: torch.Tensor


def speculative_layout(decodes: list[RunnerRequest], prefills: list[tuple[RunnerRequest, int]],
                       num_speculative_tokens: int
                       ) -> tuple[list[RunnerRequest], list[tuple[RunnerRequest, int]],
                                  list[RunnerRequest], int]:
    """Where a step's decoding requests run: (decode rows' requests, prefill chunks, verify
    chunks' requests, q_len of the decode rows). Without speculation every decode is one row.
    A speculating engine verifies each request with all k drafts as k + 1 decode rows (the
    decode kernels' q_len > 1, one plan for all); then the plain decodes beside them run as
    one-token chunks after the prefills, and requests verifying fewer drafts (cut by
    max_tokens or the model length) as chunks after those."""
    k = num_speculative_tokens
    verifies = [r for r in decodes if 0 < r.num_drafts < k]
    full = [r for r in decodes if k and r.num_drafts == k]
    plain = [r for r in decodes if not r.num_drafts]
    if not full:
        return plain, prefills, verifies, 1
    return full, [*prefills, *((r, 1) for r in plain)], verifies, k + 1


def from_previous_launch(previous: DeviceDrafts | None, decodes: list[RunnerRequest],
                         num_verify_chunks: int, decode_ids: torch.Tensor,
                         decode_positions: torch.Tensor, q_len: int, inputs: PersistentBatch
                         ) -> FromDevice | None:
    """Decode rows (q_len k + 1: drafts left on the device are always all k) of requests that
    verify drafts the previous launch left on the device (`previous`; it had not landed when
    this step was scheduled): their input tokens become that launch's newest token and drafts,
    and their positions move back by its rejections (in place, in decode_ids and
    decode_positions [d * q_len]). The corrections cover every verifying request: these
    decodes, then the verify chunks (0). None when there are none."""
    at = [i for i, r in enumerate(decodes) if r.num_device_drafts]
    if not at:
        return None
    newest, rejected, drafts = previous.take([decodes[i].request_id for i in at], inputs)
    rows_in = torch.cat([newest[:, None], drafts], dim=1)  # [n, q_len]
    if len(at) == len(decodes) and not num_verify_chunks:  # every verifying request
        decode_ids.view(-1, q_len).copy_(rows_in)
        decode_positions.view(-1, q_len).sub_(rejected[:, None])
        return FromDevice(None, drafts, rejected)
    index = inputs.to_device(at, torch.int64)
    decode_ids.view(-1, q_len)[index] = rows_in
    decode_positions.view(-1, q_len)[index] -= rejected[:, None]
    corrections = torch.zeros(len(decodes) + num_verify_chunks, dtype=torch.int64,
                              device=decode_ids.device)
    corrections[index] = rejected
    return FromDevice(index, drafts, corrections)


def verify(requests: list[RunnerRequest], logits: torch.Tensor, inputs: PersistentBatch,
           grammar_bitmask: GrammarBitmask | None = None,
           from_device: FromDevice | None = None) -> Verification:
    """The tokens each verifying request emits, on the device (no host wait).

    Args:
        requests: the verifying requests, each with d_r >= 1 drafts (`num_drafts`: known on
            the host, or left on the device by the previous launch: `from_device`) and its
            input position n_r = num_computed_tokens (less its correction there).
        logits: [sum(d_r + 1), V] float32, the main model's logits at n_r .. n_r + d_r, request
            after request.
        grammar_bitmask: the step's grammar masks (a constrained request: one per position).
    """
    host_drafts = [r.num_drafts for r in requests]
    k = max(host_drafts)
    counts = [d + 1 for d in host_drafts]
    # per logits row: its request's persistent row and the index of the token it samples
    rows = [r.row for r, c in zip(requests, counts, strict=True) for _ in range(c)]
    positions = [r.num_computed_tokens + 1 + i for r, c in zip(requests, counts, strict=True)
                 for i in range(c)]
    # per request its k + 1 rows, rows past its d_r + 1 repeating its last
    starts = list(accumulate(counts[:-1], initial=0))
    index = [s + min(i, c - 1) for s, c in zip(starts, counts, strict=True)
             for i in range(k + 1)]
    drafts = [t for r in requests  # -1 past a request's drafts
              for t in r.draft_token_ids + [-1] * (k - len(r.draft_token_ids))]
    rows, positions, counts_d, index, drafts, num_drafts = inputs.to_device_parts(
        [rows, positions, counts, index, drafts, host_drafts], torch.int64)
    gather, drafts = index.view(-1, k + 1), drafts.view(-1, k)  # [N, k + 1], [N, k]
    if from_device is not None:  # the host counted the previous step's drafts as accepted
        positions = positions - from_device.corrections.repeat_interleave(counts_d)
        if from_device.index is None:
            drafts = from_device.drafts
        else:
            drafts[from_device.index] = from_device.drafts
    # the drafts before each position count as generated (penalties, min_tokens: requests
    # with those verify drafts known on the host)
    repeated = [AheadOfDrafts(r, r.draft_token_ids[:i])
                for r, c in zip(requests, counts, strict=True) for i in range(c)]
    batch = inputs.sampling_batch(repeated, rows, positions, grammar_bitmask)
    if batch.all_greedy:  # no distributions, no noise: the drafts against the argmax
        target_ids = processed_logits(logits, batch).argmax(dim=-1)  # [R]
        tokens, emitted = greedy_verify(target_ids[gather], drafts)
        return Verification(tokens, emitted, host_drafts)
    tokens, emitted = sampled_verify(logits, batch, gather, drafts, num_drafts)
    return Verification(tokens, emitted, host_drafts)


@dataclass
class EmittedLogprobs:
    """The verified requests that ask for logprobs, with the top-`logprobs` entries at every
    one of their d + 1 positions (host copies, valid once the step's event completes): the
    chosen token's logprob [R], the top values [R, n] and ids [R, n], request after request."""

    requests: list[RunnerRequest]
    chosen: torch.Tensor
    values: torch.Tensor
    ids: torch.Tensor

    def entries(self, outcomes: dict[str, Verified]) -> dict[str, list[dict[int, float]]]:
        """{token: logprob} per token each request emitted (its first len(tokens) positions)."""
        chosen, values, ids = self.chosen.tolist(), self.values.tolist(), self.ids.tolist()
        out, start = {}, 0
        for request in self.requests:
            outcome, n = outcomes[request.request_id], request.params.logprobs
            entries = []
            for j, token in enumerate(outcome.tokens):
                entry = dict(zip(ids[start + j][:n], values[start + j][:n], strict=True))
                entry[token] = chosen[start + j]
                entries.append(entry)
            out[request.request_id] = entries
            start += outcome.num_drafts + 1
        return out


def emitted_logprobs(requests: list[RunnerRequest], verification: Verification,
                     logits: torch.Tensor, inputs: PersistentBatch) -> EmittedLogprobs | None:
    """For the verified requests that ask for logprobs: the token's and the top `logprobs` of
    the model's raw distribution at each of their positions (as a step without speculation
    reports them), copied to the host without waiting; the tokens emitted pick which of them
    are reported (`EmittedLogprobs.entries`). logits: as `verify` took them."""
    starts = accumulate((d + 1 for d in verification.num_drafts[:-1]), initial=0)
    wanting = [(i, r, s) for i, (r, s) in enumerate(zip(requests, starts, strict=True))
               if r.params.logprobs is not None]
    if not wanting:
        return None
    counts = [verification.num_drafts[i] + 1 for i, _, _ in wanting]
    rows, index = inputs.to_device_parts(
        [[s + j for (_, _, s), c in zip(wanting, counts, strict=True) for j in range(c)],
         [v for (i, _, _), c in zip(wanting, counts, strict=True) for j in range(c)
          for v in (i, j)]], torch.int64)
    index = index.view(-1, 2)  # [R, 2]: (verification, position)
    targets = verification.tokens[index[:, 0], index[:, 1]].clamp(min=0)  # -1: not emitted
    k = max(r.params.logprobs for _, r, _ in wanting)
    chosen, values, ids = (t.to("cpu", non_blocking=True) for t in top_logprobs(
        logits[rows].log_softmax(dim=-1), targets, k))
    return EmittedLogprobs([r for _, r, _ in wanting], chosen, values, ids)


@dataclass
class DraftRows:
    """The step's token axis as the MTP module reads it, on the device: each row's next token
    [T] int64 (a filler where unknown), and per speculating sampler the row [S] and position
    [S] int64 of its last computed token and how many of the drafts it verified this step
    were rejected [S] int64."""

    next_ids: torch.Tensor
    last_rows: torch.Tensor
    last_positions: torch.Tensor
    rejected: torch.Tensor

    def for_next_launch(self, drafting: list[RunnerRequest], drafts: torch.Tensor
                        ) -> DeviceDrafts:
        """What the next launch reads if it comes before this one lands: each drafting
        request's newest token (the one after its last computed position), rejected count and
        drafts [S, k]."""
        return DeviceDrafts({r.request_id: i for i, r in enumerate(drafting)},
                            self.next_ids[self.last_rows], self.rejected, drafts)


def draft_rows(num_rows: int, decodes: list[RunnerRequest],
               prefills: list[tuple[PrefillChunk, tuple[RunnerRequest, int]]],
               verifies: list[tuple[int, int, RunnerRequest]], sampled: torch.Tensor | None,
               plain_ids: list[str], verification: Verification | None,
               drafting: list[RunnerRequest], inputs: PersistentBatch,
               corrections: torch.Tensor | None = None) -> DraftRows:
    """The MTP module's view of a step's num_rows token rows, built on the device from the
    step's samples and verification (no host wait): each row's next token, and each drafting
    request's last computed row and position.

    Args:
        decodes: the plain decode rows' requests (row i: decodes[i]).
        prefills: each prefill chunk (plain decodes beside verifying rows among them) and its
            (request, tokens).
        verifies: each verifying request's rows (first row, rows, request): decode rows of
            q_len k + 1 or a chunk, in the verification's order.
        sampled: [P] int64 the plain samplers' new tokens, in the order of `plain_ids` (None
            without plain samplers).
        corrections: [N] int64 per verifying request, how far the previous step's rejections
            move its host positions back (`FromDevice`); None: nowhere.
    """
    host_next = [0] * num_rows  # fillers where unknown (past a rejection)
    sample_rows, sample_sources = [], []  # rows whose next token is a plain sample
    plain_index = {request_id: i for i, request_id in enumerate(plain_ids)}
    # per request id: (row, position) of its last computed token, before the emitted count
    last: dict[str, tuple[int, int]] = {}
    for i, request in enumerate(decodes):
        sample_rows.append(i)
        sample_sources.append(plain_index[request.request_id])
        last[request.request_id] = (i, request.num_computed_tokens)
    for chunk, (request, count) in prefills:
        start, known, first = request.num_computed_tokens, request.token_ids, chunk.token_start
        # rows whose next token is known (the prompt's), then the sampling row, if any
        num_known = max(0, min(count, len(known) - 1 - start))
        host_next[first:first + num_known] = known[start + 1:start + 1 + num_known]
        if num_known < count:
            sample_rows.append(first + count - 1)
            sample_sources.append(plain_index[request.request_id])
        last[request.request_id] = (first + count - 1, start + count - 1)
    verify_rows, verify_index = [], []  # rows of verified tokens, and (request, offset)
    verifying: dict[str, int] = {}
    for v, (first, count, request) in enumerate(verifies):
        verify_rows += range(first, first + count)
        verify_index += [value for j in range(count) for value in (v, j)]
        verifying[request.request_id] = v
        last[request.request_id] = (first - 1, request.num_computed_tokens - 1)
    # every input in one copy: [T], the sampled rows and sources, the verified rows and their
    # (request, offset) pairs, each drafting request's last row, position and verification
    # index, each verification's drafts
    host_which = [verifying.get(r.request_id, -1) for r in drafting]
    next_ids, rows, sources, v_rows, index, last_rows, last_positions, which, drafted = (
        inputs.to_device_parts(
            [host_next, sample_rows, sample_sources, verify_rows, verify_index,
             [last[r.request_id][0] for r in drafting],
             [last[r.request_id][1] for r in drafting], host_which,
             verification.num_drafts if verification is not None else []], torch.int64))
    if sample_rows:
        next_ids[rows] = sampled[sources]
    if verify_rows:
        index = index.view(-1, 2)  # [Rv, 2]
        # past a request's emitted tokens: -1, a filler like any other (clamped to a token)
        next_ids[v_rows] = verification.tokens[index[:, 0], index[:, 1]].clamp(min=0)
    if verification is None:
        return DraftRows(next_ids, last_rows, last_positions, torch.zeros_like(which))
    # per drafting request: tokens emitted, drafts verified and position correction (none
    # where it did not verify: -1 drafts, so 0 rejected)
    emitted, drafted_s, corrected = verification.emitted, drafted, corrections  # [S] each
    if host_which != list(range(len(verifies))):  # not every verification, in order
        verified, at = which >= 0, which.clamp(min=0)
        emitted = torch.where(verified, emitted[at], 0)
        drafted_s = torch.where(verified, drafted[at], -1)
        if corrections is not None:
            corrected = torch.where(verified, corrections[at], 0)
    positions = last_positions + emitted
    if corrected is not None:
        positions = positions - corrected
    return DraftRows(next_ids, last_rows + emitted, positions, drafted_s + 1 - emitted)


@dataclass
class ReplayedStep:
    """A step whose forward replayed a decode graph: its n requests' block table [n, width]
    int32, lengths [n] int32, rows per request and the graph's batch size: the drafting graph
    of that key replays next (or the eager first pass runs, planned as that graph was)."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    q_len: int
    graph_size: int


def draft(model, mtp_cache: torch.Tensor, meta: AttentionMetadata, backend,
          inputs: PersistentBatch, block_size: int, num_speculative_tokens: int,
          rows: DraftRows, hidden: torch.Tensor, positions: torch.Tensor,
          samplers: list[RunnerRequest], graphs: DraftGraphs | None = None,
          replayed: ReplayedStep | None = None, prefill_length: int | None = None,
          expert_capacity: int = 0) -> torch.Tensor:
    """k greedy drafts per speculating sampler ([S, k] int64 on the device; no host wait).

    The first pass runs over every row of the step, so the MTP layer's cache holds every
    position the main model computed; with no speculating sampler (a prompt chunk that does
    not sample yet, requests that do not speculate) it is the only pass, and S = 0.

    Args:
        model: the main model, with its MTP module (`model.mtp`).
        mtp_cache: the MTP layer's latent cache.
        meta: the step's attention metadata (its slots and chunks are the MTP layer's too;
            its decode backend planned, unless the step replayed a graph: `replayed`).
        hidden: [T, D] the main model's output over the step's rows; positions: [T] int64.
        graphs: the captured drafting, all k passes, replayed where the step's forward replayed a
            decode graph (`replayed`); else the first pass runs eagerly, then passes 2..k
            replay `graphs.recursive` where it covers the drafting requests.
        prefill_length: the prefill graph's length where the step's forward replayed one (one
            prompt from position 0): `graphs.after_prefill` runs all k passes.
        expert_capacity: under expert parallelism (else 0), the rows per rank of the MoE
            exchanges of every pass; all k passes run, with no sampler too (the other
            replicas' passes meet them), and eagerly (no drafting graphs).
    """
    device = hidden.device
    next_ids, last = rows.next_ids, rows.last_rows  # [T], [S]
    if samplers and replayed is not None and graphs is not None:  # all k passes at once
        return graphs.run(next_ids, last, rows.last_positions, replayed.q_len,
                          replayed.graph_size)
    after_prefill = None if graphs is None else graphs.after_prefill
    width = max((len(r.block_ids) for r in samplers), default=0)
    if (prefill_length is not None and after_prefill is not None
            and width <= after_prefill.max_blocks_per_seq):  # S <= 1: one prompt's step
        table = inputs.table_rows([r.row for r in samplers])[:, :width] if samplers else None
        return after_prefill.run(next_ids, last, rows.last_positions, table, prefill_length)
    if replayed is not None:  # the replay left the backend planned for its graph only
        backend.plan_like_graph(replayed.block_table, replayed.seq_lens, replayed.graph_size,
                                replayed.q_len)
    mtp_hidden = model.mtp(next_ids, positions, hidden, mtp_cache, meta,
                           expert_capacity or None)  # [T, D]
    if not samplers:  # the cache filled; nothing to draft
        for _ in range(num_speculative_tokens - 1 if expert_capacity else 0):
            model.mtp.join_expert_parallel(expert_capacity)
        return torch.empty(0, num_speculative_tokens, dtype=torch.int64, device=device)
    previous = mtp_hidden[last]  # [S, D]
    token = model.compute_logits(previous).argmax(dim=-1)  # [S]
    drafts = [token]
    if num_speculative_tokens > 1:
        table = inputs.table_rows([r.row for r in samplers])[:, :width]  # [S, width]
        recursive = None if graphs is None else graphs.recursive
        if recursive is not None and recursive.covers(len(samplers), width):
            rest = recursive.run(token, previous, rows.last_positions, table)  # [S, k - 1]
            return torch.cat([token[:, None], rest], dim=1)
        # every recursive pass's positions, slots and lengths at once, a pass a row: [k - 1, S]
        passes = (rows.last_positions[None, :]
                  + torch.arange(1, num_speculative_tokens, device=device)[:, None])
        all_slots = cache_slots(table, passes.t().reshape(-1), block_size).view(
            len(samplers), -1).t().contiguous()
        all_lens = (passes + 1).to(torch.int32)
        for position, slots, seq_lens in zip(passes, all_slots, all_lens, strict=True):
            backend.plan(table, seq_lens)
            step_meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=len(samplers),
                                          prefills=[])
            step_meta.decode_backend = backend
            previous = model.mtp(token, position, previous, mtp_cache, step_meta,
                                 expert_capacity or None)
            token = model.compute_logits(previous).argmax(dim=-1)
            drafts.append(token)
    return torch.stack(drafts, dim=1)
