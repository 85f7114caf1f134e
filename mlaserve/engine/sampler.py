"""Batched sampling on the device: penalties, temperature, top-k, top-p, min-p, seeded noise.

Per-row parameters come from the persistent batch's device tensors (see input_batch.py), so a
step builds no per-request tensors. The common case, temperature sampling (or greedy) with no
top-k / top-p / min-p, runs the sort-free Gumbel-max pass of `kernels/sampling.py`; only a batch
in which some request asks for a filter sorts the vocabulary. Noise is a pure function of
(request seed, position, vocabulary index), so a seeded request samples the same tokens in any
batch. Structured outputs: the rows of constrained requests get their grammar's token bitmask
(structured.py) applied before any of these paths, so greedy, Gumbel and filtered sampling alike
pick only allowed tokens.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from mlaserve.engine.request import SamplingParams
from mlaserve.engine.structured import apply_token_bitmask
from mlaserve.kernels.sampling import SEED_MASK, gumbel_argmax, seeded_uniform


class SamplingState(Protocol):
    """What sampling reads of a request: a runner's `RunnerRequest` (input_batch.py), or the
    core's `Request` where tests build a batch from those."""

    request_id: str
    params: SamplingParams
    sample_seed: int
    eos_token_ids: tuple[int, ...]
    prompt_token_ids: list[int]

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens_total(self) -> int: ...

    @property
    def num_total_tokens(self) -> int: ...


@dataclass
class Penalties:
    """vLLM's penalties for the rows that sample: [N] float32 factors and [N, V] token stats."""

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    output_counts: torch.Tensor  # [N, V] float32 counts of generated tokens
    seen_prompt: torch.Tensor  # [N, V] bool: token present in the prompt

    @classmethod
    def build(cls, requests: list[SamplingState], vocab_size: int,
              device: torch.device) -> "Penalties":
        """From the requests' token lists (all generated tokens must be known on the host)."""
        params = [r.params for r in requests]
        n = len(requests)
        output_counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        out_rows, out_ids = _pairs([r.output_token_ids for r in requests], device)
        output_counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids,
                                 dtype=torch.float32), accumulate=True)
        seen_prompt = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
        seen_prompt[_pairs([r.prompt_token_ids for r in requests], device)] = True

        def factors(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32,
                                device=device)

        return cls(factors("presence_penalty"), factors("frequency_penalty"),
                   factors("repetition_penalty"), output_counts, seen_prompt)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM semantics: repetition over prompt+output tokens, presence/frequency over output."""
        counts = self.output_counts
        seen_any = self.seen_prompt | (counts > 0)
        rep = self.repetition[:, None]
        logits = torch.where(seen_any, torch.where(logits > 0, logits / rep, logits * rep),
                             logits)
        logits = logits - self.frequency[:, None] * counts
        return logits - self.presence[:, None] * (counts > 0).float()


@dataclass
class RowParams:
    """Sampling parameters of S rows, on the device: temperature [S] float32 (0 = greedy),
    top_k [S] int64 (vocab size = off), top_p [S] and min_p [S] float32, seeds [S] int64 (the
    runner's persistent batch holds them a row per request)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor


class _Gathered:
    """A `SamplingBatch` parameter of its rows, gathered from `params` at the first read and
    kept on the instance from then on."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, batch: "SamplingBatch", owner: type | None = None) -> torch.Tensor:
        values = getattr(batch.params, self.name)
        if batch.rows is not None:
            values = values[batch.rows]
        batch.__dict__[self.name] = values
        return values


@dataclass
class SamplingBatch:
    """The N rows that sample this step (requests, or a verification's positions): where each
    one's parameters are in `params` (`rows` [N] int64, None: 0..N-1), each parameter gathered
    at its first read (a greedy batch reads none), and the rest of the step's sampling inputs."""

    params: RowParams
    rows: torch.Tensor | None
    positions: torch.Tensor  # [N] int64: index of the token being sampled
    all_greedy: bool
    needs_filter: bool  # some row asks for top-k, top-p or min-p
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids): EOS/stops too early
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, ids, values)
    # (rows [M] int64, bitmask [M, ceil(V / 32)] int32): grammar masks of constrained rows
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None

    temperature = _Gathered()  # [N] float32
    top_k = _Gathered()  # [N] int64
    top_p = _Gathered()  # [N] float32
    min_p = _Gathered()  # [N] float32
    seeds = _Gathered()  # [N] int64

    @classmethod
    def build(cls, requests: list[SamplingState], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        """Straight from the requests' parameters (tests and tools; the runner gathers the same
        rows from its persistent batch instead)."""
        params = [r.params for r in requests]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            params=RowParams(
                temperature=tensor([p.temperature for p in params], torch.float32),
                top_k=tensor([top_k_or_vocab(p.top_k, vocab_size) for p in params],
                             torch.int64),
                top_p=tensor([p.top_p for p in params], torch.float32),
                min_p=tensor([p.min_p for p in params], torch.float32),
                seeds=tensor([r.sample_seed & SEED_MASK for r in requests], torch.int64)),
            rows=None,
            positions=tensor([r.num_total_tokens for r in requests], torch.int64),
            all_greedy=all(p.temperature == 0 for p in params),
            needs_filter=any(needs_filter(p) for p in params),
            penalties=(Penalties.build(requests, vocab_size, device)
                       if any(needs_penalties(p) for p in params) else None),
            banned=banned_before_min_tokens(requests, device),
            bias=logit_bias(requests, device))


def top_k_or_vocab(top_k: int, vocab_size: int) -> int:
    """The number of tokens top-k keeps: the vocabulary when off (-1, 0) or larger than it."""
    return min(top_k, vocab_size) if top_k > 0 else vocab_size


def needs_filter(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1 or params.min_p > 0


def needs_penalties(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


def banned_before_min_tokens(requests: list[SamplingState], device: torch.device,
                             must_end: set[str] | frozenset[str] = frozenset()
                             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, ids) of EOS and stop ids that rows may not sample yet (min_tokens), or None.

    must_end: ids of the requests whose grammar allows nothing but its end; they are not banned
    (the constraint ends the request before min_tokens; `GrammarBitmask.must_end`).
    """
    if not any(r.params.min_tokens for r in requests):
        return None  # the usual step: no row counts up to a min_tokens
    lists = [list(r.eos_token_ids) + r.params.stop_token_ids
             if r.num_output_tokens_total < r.params.min_tokens
             and r.request_id not in must_end else [] for r in requests]
    return _pairs(lists, device) if any(lists) else None


def logit_bias(requests: list[SamplingState], device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows [M], ids [M], values [M] float32) of the rows' logit_bias entries, or None."""
    biases = [r.params.logit_bias or {} for r in requests]
    if not any(biases):
        return None
    rows, ids = _pairs([list(b) for b in biases], device)
    values = torch.tensor([v for b in biases for v in b.values()], dtype=torch.float32,
                          device=device)
    return rows, ids, values


def _pairs(rows_of_ids: list[list[int]], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-row id lists -> flat (row index [M], id [M]) int64 tensors for one scatter."""
    rows = [i for i, ids in enumerate(rows_of_ids) for _ in ids]
    flat = [t for ids in rows_of_ids for t in ids]
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(flat, dtype=torch.int64, device=device))


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 after the rows' penalties, logit bias, min_tokens bans and
    grammar masks: what `sample` and `target_probs` draw from."""
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)
    if batch.bias is not None:
        rows, ids, values = batch.bias
        logits = logits.index_put((rows, ids), values, accumulate=True)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.allowed is not None:
        logits = apply_token_bitmask(logits, *batch.allowed)
    return logits


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N] int64."""
    logits = processed_logits(logits, batch)
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    if not batch.needs_filter:
        sampled = gumbel_argmax(logits, batch.temperature, batch.seeds, batch.positions)
    else:
        sampled = _sample_filtered(logits, batch)
    if batch.allowed is not None:
        sampled = _keep_allowed(sampled, logits, *batch.allowed)
    return sampled


def _keep_allowed(sampled: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor,
                  bitmask: torch.Tensor) -> torch.Tensor:
    """A constrained row whose sample is not allowed takes its best allowed token instead.

    The noise may be extreme for a token (a uniform draw that rounds to 1 in float32 gives a
    Gumbel of +inf, an Exp(1) of 0), and -inf + inf is NaN, which argmax picks: a masked token
    could win. sampled [N] int64, logits [N, V] (masked), rows [M] int64, bitmask [M, W] int32.
    """
    chosen = sampled[rows]
    words = bitmask.gather(1, (chosen // 32)[:, None]).squeeze(1)
    allowed = ((words >> (chosen % 32).to(torch.int32)) & 1).bool()
    best = logits[rows].argmax(dim=-1)
    return sampled.index_put((rows,), torch.where(allowed, chosen, best))


def _sample_filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k, then top-p and min-p over the sorted probabilities, then an exponential race."""
    probs = _filtered_probs(logits, batch)
    noise = -torch.log(seeded_uniform(batch.seeds, batch.positions, logits.shape[-1]))  # Exp(1)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.temperature > 0, sampled, logits.argmax(dim=-1))


def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[N, V] softmax(logits / temperature) after top-k, then top-p and min-p over the sorted
    probabilities (a greedy row's temperature counts as 1)."""
    vocab = logits.shape[-1]
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    scaled = logits / temperature[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= batch.top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (always the first token)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= batch.top_p[:, None]
    drop |= sorted_probs < batch.min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.zeros_like(scaled).scatter_(1, sorted_ids, sorted_logits.softmax(dim=-1))


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 -> [N, V] float32, the distribution `sample` draws each row from
    (after `processed_logits`): one-hot at the argmax for a greedy row, else the tempered,
    filtered softmax. Speculative decoding verifies drafts against it."""
    logits = processed_logits(logits, batch)
    greedy = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if batch.all_greedy:
        return greedy
    if batch.needs_filter:
        probs = _filtered_probs(logits, batch)
    else:
        temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
        probs = (logits / temperature[:, None]).softmax(dim=-1)
    return torch.where((batch.temperature > 0)[:, None], probs, greedy)


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen tokens' logprobs [N] and the top-k (values [N, k], ids [N, k])."""
    chosen = logprobs.gather(1, token_ids[:, None].long()).squeeze(1)
    if k == 0:
        empty = logprobs.new_empty(logprobs.shape[0], 0)
        return chosen, empty, empty.long()
    values, ids = logprobs.topk(k, dim=-1)
    return chosen, values, ids
