"""Batched sampling on the device: penalties, temperature, top-k, top-p, min-p, seeded noise.

Randomness is counter-based: the noise for a request's token at position p is a hash of
(request seed, p, vocab index), so a seeded request samples the same tokens whatever else is in
the batch, and nothing is synchronised with the host per request.
"""

from dataclasses import dataclass

import torch

from mlaserve.engine.request import Request

_MASK63 = (1 << 63) - 1


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors (rows = requests that sample this step)."""

    temperature: torch.Tensor  # [N] float32 (0 = greedy)
    top_k: torch.Tensor  # [N] int64 (vocab size = off)
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    seeds: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64: index of the token being sampled
    presence: torch.Tensor  # [N] float32
    frequency: torch.Tensor  # [N] float32
    repetition: torch.Tensor  # [N] float32
    needs_penalties: bool
    output_counts: torch.Tensor | None  # [N, V] float32 counts of generated tokens
    seen_prompt: torch.Tensor | None  # [N, V] bool prompt tokens present
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, ids): EOS/stop ids before min_tokens
    all_greedy: bool

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        params = [r.params for r in requests]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        needs_penalties = any(p.presence_penalty or p.frequency_penalty
                              or p.repetition_penalty != 1.0 for p in params)
        output_counts = seen_prompt = None
        if needs_penalties:
            n = len(requests)
            output_counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
            seen_prompt = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
            out_rows, out_ids = _pairs([r.output_token_ids for r in requests], device)
            output_counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids,
                                     dtype=torch.float32), accumulate=True)
            seen_prompt[_pairs([r.prompt_token_ids for r in requests], device)] = True
        banned_lists = [list(r.eos_token_ids) + r.params.stop_token_ids
                        if len(r.output_token_ids) < r.params.min_tokens else []
                        for r in requests]
        banned = _pairs(banned_lists, device) if any(banned_lists) else None
        return cls(
            temperature=tensor([p.temperature for p in params], torch.float32),
            top_k=tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            seeds=tensor([r.sample_seed & _MASK63 for r in requests], torch.int64),
            positions=tensor([r.num_tokens for r in requests], torch.int64),
            presence=tensor([p.presence_penalty for p in params], torch.float32),
            frequency=tensor([p.frequency_penalty for p in params], torch.float32),
            repetition=tensor([p.repetition_penalty for p in params], torch.float32),
            needs_penalties=needs_penalties,
            output_counts=output_counts,
            seen_prompt=seen_prompt,
            banned=banned,
            all_greedy=all(p.temperature == 0 for p in params),
        )


def _pairs(rows_of_ids: list[list[int]], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-row id lists -> flat (row index [M], id [M]) int64 tensors for one scatter."""
    rows = [i for i, ids in enumerate(rows_of_ids) for _ in ids]
    flat = [t for ids in rows_of_ids for t in ids]
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(flat, dtype=torch.int64, device=device))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A splitmix64-style integer mixer on int64 (wrapping arithmetic, logical shifts)."""
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15 as signed int64
    x = x ^ ((x >> 29) & ((1 << 35) - 1))
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as signed int64
    return x ^ ((x >> 32) & ((1 << 32) - 1))


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise [N, V] float32, a pure function of (seed, position, vocab index)."""
    row = _mix(seeds * 1000003 + positions * 7919 + 12345)  # [N]
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix(row[:, None] ^ (cols[None, :] * -7046029254386353131))  # [N, V]
    mantissa = (bits >> 40) & ((1 << 24) - 1)  # 24 random bits
    return (mantissa.float() + 0.5) / float(1 << 24)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output tokens, presence/frequency over output."""
    counts, seen = batch.output_counts, batch.seen_prompt
    seen_any = seen | (counts > 0)
    rep = batch.repetition[:, None]
    logits = torch.where(seen_any, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - batch.frequency[:, None] * counts
    return logits - batch.presence[:, None] * (counts > 0).float()


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N] int64."""
    if batch.needs_penalties:
        logits = apply_penalties(logits, batch)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
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
    probs = torch.zeros_like(scaled).scatter_(1, sorted_ids, sorted_logits.softmax(dim=-1))
    noise = -torch.log(seeded_uniform(batch.seeds, batch.positions, vocab))  # Exp(1)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.temperature > 0, sampled, greedy_ids)


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen tokens' logprobs [N] and the top-k (values [N, k], ids [N, k])."""
    chosen = logprobs.gather(1, token_ids[:, None].long()).squeeze(1)
    if k == 0:
        empty = logprobs.new_empty(logprobs.shape[0], 0)
        return chosen, empty, empty.long()
    values, ids = logprobs.topk(k, dim=-1)
    return chosen, values, ids
