"""Speculative decoding's verification: the rejection rule under which the tokens emitted follow
the target model's distribution exactly (Leviathan et al. 2023; Chen et al. 2023), as vLLM
verifies drafts.

A request drafts d_1..d_k with probabilities q_1..q_k (one-hot for a greedy draft, as the MTP
module drafts); the target's forward over the k + 1 positions gives p_1..p_{k+1}, each after the
request's own penalties, temperature and top-k / top-p / min-p (the distribution plain sampling
would draw from at that position). In order,

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
    at the first rejection, at i, emit a token drawn from norm(max(0, p_i - q_i)) and stop;
    if all k are accepted, emit a bonus token drawn from p_{k+1}.

Each emitted token, given the tokens before it, is then distributed as p at its position, so the
output's distribution is the target's whatever the draft. A greedy request (temperature 0) passes
p as the one-hot of the target's argmax: a draft is accepted exactly when it is that argmax and
the first mismatch emits the argmax, so its output equals decoding without speculation.

The randomness comes in as arguments (a uniform per draft, Exp(1) noise per position and
vocabulary entry), so the caller draws it from the request's seed and position as plain sampling
does (`kernels.sampling.seeded_uniform`).
"""

import torch

from mlaserve.engine.sampler import SamplingBatch, target_probs
from mlaserve.kernels.sampling import SEED_MASK, seeded_uniform

ACCEPT_SALT = 0x5EED_ACCE  # the acceptance uniforms' stream, apart from the sampler's noise


def rejection_sample(target_probs: torch.Tensor, draft_ids: torch.Tensor,
                     num_drafts: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor,
                     draft_probs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of N requests; (tokens, num_emitted).

    Args:
        target_probs: [N, k + 1, V] float32, p at each verified position (rows of a request
            with fewer than k drafts are read up to its own k_n + 1).
        draft_ids: [N, k] int64, the drafts (past num_drafts: any token id, or -1).
        num_drafts: [N] int64 in [0, k], k_n.
        uniform: [N, k] float32 in [0, 1), one per draft.
        noise: [N, k + 1, V] float32, Exp(1) noise of the recovery / bonus draw.
        draft_probs: [N, k, V] float32 q, or None for greedy drafts (q one-hot at the draft).
    Returns:
        tokens [N, k + 1] int64: the accepted drafts, then the recovered or bonus token, then
        -1; num_emitted [N] int64 in [1, k_n + 1].
    """
    rows, k = draft_ids.shape
    arange = torch.arange(rows, device=draft_ids.device)
    draft_ids = draft_ids.clamp(min=0)  # past num_drafts: read, never accepted
    p_of_draft = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)  # [N, k]
    if draft_probs is None:
        accept = uniform < p_of_draft  # q(d) = 1
    else:
        q_of_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)  # [N, k]
        accept = uniform * q_of_draft < p_of_draft
    accept &= torch.arange(k, device=draft_ids.device)[None, :] < num_drafts[:, None]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [N], the first rejection's index
    p_last = target_probs[arange, num_accepted]  # [N, V]
    rejected = num_accepted < num_drafts  # [N]: else every draft held and the bonus is drawn
    at = num_accepted.clamp(max=max(k - 1, 0))
    if k > 0:
        if draft_probs is None:
            q_last = torch.zeros_like(p_last).scatter_(1, draft_ids[arange, at][:, None], 1.0)
        else:
            q_last = draft_probs[arange, at]  # [N, V]
        residual = (p_last - q_last).clamp(min=0)
        # p = q exactly leaves nothing, but then the draft is never rejected: keep p there
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)
        p_last = torch.where(rejected[:, None], residual, p_last)
    # an exponential race; Exp(1) noise can be 0 (a uniform that rounds to 1), and a token p
    # leaves out (filtered, masked by a grammar) must not win it as 0 / 0
    race = torch.where(p_last > 0, p_last / noise[arange, num_accepted], 0.0)
    last = race.argmax(dim=-1)  # [N]
    positions = torch.arange(k + 1, device=draft_ids.device)[None, :]  # [1, k + 1]
    drafts = torch.cat([draft_ids, draft_ids.new_full((rows, 1), -1)], dim=1)  # [N, k + 1]
    tokens = torch.where(positions < num_accepted[:, None], drafts,
                         torch.where(positions == num_accepted[:, None], last[:, None], -1))
    return tokens, num_accepted + 1


def greedy_verify(target_ids: torch.Tensor, draft_ids: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample` where every target is greedy (p one-hot at its argmax), without the
    distributions or the noise: a draft is accepted exactly when it is the target's argmax, and
    the token after the accepted ones is the argmax at that position (the recovery and the
    bonus draw both land on it).

    Args:
        target_ids: [N, k + 1] int64, the argmax of p at each verified position.
        draft_ids: [N, k] int64, -1 past each request's drafts (no target equals it).
    Returns:
        as `rejection_sample`: tokens [N, k + 1] (the target's argmax up to the first
        rejection included, then -1) and num_emitted [N].
    """
    k = draft_ids.shape[1]
    num_accepted = (draft_ids == target_ids[:, :k]).cumprod(dim=1).sum(dim=1)  # [N]
    positions = torch.arange(k + 1, device=draft_ids.device)  # [k + 1]
    tokens = torch.where(positions <= num_accepted[:, None], target_ids, -1)
    return tokens, num_accepted + 1


def sampled_verify(logits: torch.Tensor, batch: SamplingBatch, gather: torch.Tensor,
                   draft_ids: torch.Tensor, num_drafts: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample` of N requests' greedy drafts against the distributions the sampler
    draws from, its randomness a pure function of (request seed, position) as plain sampling's:
    the recovery / bonus draw from the sampler's own noise at that position, the acceptance
    uniforms from a salted seed.

    Args:
        logits: [R, V] float32, the main model's at the verified rows; batch: those rows'
            sampling inputs (their positions: the index of the token each samples).
        gather: [N, k + 1] int64, each request's rows in `logits` (past its d_n + 1: any).
        draft_ids: [N, k] int64 (past num_drafts: any token id, or -1); num_drafts: [N].
    """
    k = draft_ids.shape[1]
    vocab = logits.shape[-1]
    target = target_probs(logits, batch)[gather]  # [N, k + 1, V] target distributions
    noise = -torch.log(seeded_uniform(batch.seeds, batch.positions, vocab))[gather]  # Exp(1)
    first_rows = gather[:, 0]
    salted = (batch.seeds[first_rows] ^ ACCEPT_SALT) & SEED_MASK
    uniform = torch.stack([seeded_uniform(salted, batch.positions[first_rows] + i, 1)[:, 0]
                           for i in range(k)], dim=1)  # [N, k]
    return rejection_sample(target, draft_ids, num_drafts, uniform, noise)
