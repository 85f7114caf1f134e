"""Speculative verification (`engine.rejection_sampler`): greedy rows decode exactly as without
speculation; sampled rows emit tokens distributed as the target, at temperature 0.8 with top-p,
for greedy (one-hot) and sampled drafts, by total variation over 200,000 draws with a bound a
wrong recovery rule exceeds ten times over."""

import torch

from mlaserve.engine.rejection_sampler import greedy_verify, rejection_sample

VOCAB, DRAWS = 6, 200_000
TV_BOUND = 0.01  # the empirical TV of 200k draws over 6 tokens is ~0.003


def target(logits: list[float], temperature: float = 0.8, top_p: float = 0.9) -> torch.Tensor:
    """p as plain sampling draws it: temperature, then the smallest top-p prefix."""
    probs = torch.tensor(logits).div(temperature).softmax(-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[order[before < top_p]] = True
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


def draw(p: list[torch.Tensor], drafts: torch.Tensor, q: torch.Tensor | None, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n, k = drafts.shape
    probs = torch.stack(p)[None].expand(n, k + 1, VOCAB)
    uniform = torch.rand(n, k, generator=gen)
    noise = torch.empty(n, k + 1, VOCAB).exponential_(generator=gen)
    draft_probs = None if q is None else q[None, None].expand(n, k, VOCAB)
    return rejection_sample(probs, drafts, torch.full((n,), k), uniform, noise, draft_probs)


def test_greedy_rows_decode_as_without_speculation():
    best = torch.tensor([[0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
    probs = best[None].expand(2, 3, 4)  # argmax 2, then 1, then 0 (the bonus position)
    drafts = torch.tensor([[2, 1], [2, 3]])
    tokens, emitted = rejection_sample(probs, drafts, torch.tensor([2, 2]),
                                       torch.full((2, 2), 0.999), torch.ones(2, 3, 4))
    assert tokens.tolist() == [[2, 1, 0], [2, 1, -1]] and emitted.tolist() == [3, 2]
    short, emitted = rejection_sample(probs[:1], drafts[:1], torch.tensor([1]),
                                      torch.zeros(1, 2), torch.ones(1, 3, 4))
    assert short.tolist() == [[2, 1, -1]] and emitted.tolist() == [2]  # one draft, then bonus


def test_greedy_verification_is_the_rejection_rule_on_one_hot_targets():
    """`greedy_verify` (argmax only, what an all-greedy step runs) gives exactly what
    `rejection_sample` gives on the one-hot targets, whatever the uniforms and noise: 2,000
    requests with random argmaxes, drafts that often match them and 0..4 drafts each (-1 past
    them: `rejection_sample` reads those as any token)."""
    gen = torch.Generator().manual_seed(3)
    n, k = 2000, 4
    target_ids = torch.randint(0, VOCAB, (n, k + 1), generator=gen)
    drafts = torch.where(torch.rand(n, k, generator=gen) < 0.7, target_ids[:, :k],
                         torch.randint(0, VOCAB, (n, k), generator=gen))
    num_drafts = torch.randint(0, k + 1, (n,), generator=gen)
    one_hot = torch.nn.functional.one_hot(target_ids, VOCAB).float()  # [n, k + 1, V]
    want = rejection_sample(one_hot, drafts, num_drafts, torch.rand(n, k, generator=gen),
                            torch.empty(n, k + 1, VOCAB).exponential_(generator=gen))
    padded = torch.where(torch.arange(k) < num_drafts[:, None], drafts, -1)
    got = greedy_verify(target_ids, padded)
    assert torch.equal(rejection_sample(one_hot, padded, num_drafts,
                                        torch.rand(n, k, generator=gen),
                                        torch.empty(n, k + 1, VOCAB).exponential_(
                                            generator=gen))[0], want[0])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert set(got[1].tolist()) == set(range(1, k + 2))  # every acceptance count occurs


def test_sampled_output_follows_the_target_for_greedy_and_sampled_drafts():
    p1, p2 = target([2.0, 1.5, 1.0, 0.2, -1.0, 0.5]), target([0.1, 2.2, 0.3, 1.9, 0.0, -0.5])
    q = torch.tensor([0.05, 0.1, 0.5, 0.1, 0.05, 0.2])  # a draft model that disagrees
    greedy = torch.tensor([1, 3]).expand(DRAWS, 2)  # the drafter's argmax at both positions
    gen = torch.Generator().manual_seed(1)
    sampled = torch.multinomial(q, 2 * DRAWS, replacement=True, generator=gen).view(DRAWS, 2)
    for drafts, q_given, seed in ((greedy, None, 2), (sampled, q, 3)):
        tokens, emitted = draw([p1, p2, p2], drafts, q_given, seed)
        assert tv(tokens[:, 0], p1) < TV_BOUND
        second = tokens[emitted >= 2, 1]
        assert second.numel() > DRAWS // 10 and tv(second, p2) < TV_BOUND
    # a greedy draft is accepted as often as the target picks it
    tokens, emitted = draw([p1, p2, p2], greedy, None, 4)
    assert abs((emitted >= 2).double().mean().item() - p1[1].item()) < TV_BOUND


def test_the_bound_catches_a_wrong_recovery_rule():
    """Recovering from p instead of max(0, p - q) (a classic mistake) over-samples the draft."""
    p1 = target([2.0, 1.5, 1.0, 0.2, -1.0, 0.5])
    gen = torch.Generator().manual_seed(5)
    accept = torch.rand(DRAWS, generator=gen) < p1[1]
    wrong = torch.where(accept, 1, torch.multinomial(p1, DRAWS, replacement=True,
                                                      generator=gen))
    assert tv(wrong, p1) > 10 * TV_BOUND
