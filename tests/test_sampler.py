"""Sampler: filters keep exactly the allowed tokens; penalties follow vLLM's definitions."""

import pytest
import torch

from mlaserve.engine.request import Request, SamplingParams
from mlaserve.engine.sampler import SamplingBatch, sample, seeded_uniform

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))


def draw(params: SamplingParams, n: int = 400, output_ids=(), prompt=(4,)) -> set[int]:
    requests = [Request(str(i), None, list(prompt), params, sample_seed=i,
                        output_token_ids=list(output_ids)) for i in range(n)]
    batch = SamplingBatch.build(requests, 5, torch.device("cpu"))
    return set(sample(LOGITS.repeat(n, 1), batch).tolist())


def test_filters_restrict_the_support():
    assert draw(SamplingParams(temperature=0)) == {0}
    assert draw(SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert draw(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert draw(SamplingParams(temperature=1.0, top_k=2**63 - 1)) == {0, 1, 2, 3, 4}  # clamped
    assert draw(SamplingParams(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 + 0.25 >= 0.7
    assert draw(SamplingParams(temperature=1.0, top_p=0.5)) == {0}
    assert draw(SamplingParams(temperature=1.0, min_p=0.3)) == {0, 1, 2}  # >= 0.15


def test_sampling_frequencies_follow_the_distribution():
    n = 20000
    requests = [Request(str(i), None, [4], SamplingParams(temperature=1.0), sample_seed=i)
                for i in range(n)]
    batch = SamplingBatch.build(requests, 5, torch.device("cpu"))
    counts = torch.bincount(sample(LOGITS.repeat(n, 1), batch), minlength=5).float() / n
    assert torch.allclose(counts, LOGITS.exp(), atol=0.015)


def test_noise_is_a_function_of_seed_and_position_only():
    seeds = torch.tensor([1, 2, 1])
    positions = torch.tensor([5, 5, 5])
    u = seeded_uniform(seeds, positions, 1000)
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02


def test_penalties():
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25,
                            repetition_penalty=2.0)
    req = Request("0", None, [3], params, sample_seed=0, output_token_ids=[0, 0, 1])
    batch = SamplingBatch.build([req], 5, torch.device("cpu"))
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5, 0.0]])
    out = batch.penalties.apply(logits.clone())[0].tolist()
    # token 0: seen -> 2/2 = 1, minus 0.25*2 frequency, minus 0.5 presence = 0
    # token 1: seen, negative -> -2, minus 0.25, minus 0.5 = -2.75
    # token 3: prompt only -> 0.5/2 = 0.25; tokens 2 and 4 untouched
    assert out == [0.0, -2.75, 1.0, 0.25, 0.0]


def test_min_tokens_suppresses_eos():
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    req = Request("0", None, [3], params, sample_seed=0, eos_token_ids=(0,))
    batch = SamplingBatch.build([req], 5, torch.device("cpu"))
    assert sample(LOGITS[None].clone(), batch).item() == 1


def test_sort_free_kernel_draws_what_the_torch_path_draws():
    """The Triton Gumbel-max pass (interpreted on CPU) hashes the same noise as seeded_uniform
    and picks the same ids, greedy rows included; a wrong hash bit would change most picks."""
    pytest.importorskip("triton")
    from mlaserve.kernels.interpreter import patch_triton_interpreter
    from mlaserve.kernels.sampling import _gumbel_argmax_triton, gumbel_argmax_torch

    if not torch.cuda.is_available():
        patch_triton_interpreter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(16, 3001, generator=generator) * 0.5).to(device)  # flat: noise decides
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.5] * 4, device=device)
    seeds = torch.tensor([i * 7919 + (1 << 62) * (i % 2) for i in range(16)], device=device)
    positions = torch.arange(16, device=device) * 3
    expected = gumbel_argmax_torch(logits, temperature, seeds, positions)
    assert torch.equal(_gumbel_argmax_triton(logits, temperature, seeds, positions), expected)
    assert torch.equal(expected[2::4], logits[2::4].argmax(dim=-1))


def test_logit_bias_shifts_the_logits_it_names() -> None:
    """+100 on one id makes greedy pick it; -100 on the argmax makes greedy skip it; rows
    without a bias sample as before."""
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(dim=-1)
    favoured = int((top[0] + 1) % vocab)
    params = [SamplingParams(temperature=0, logit_bias={favoured: 100.0}),
              SamplingParams(temperature=0, logit_bias={int(top[1]): -100.0}),
              SamplingParams(temperature=0)]
    requests = [Request(f"r{i}", None, [1, 2], p, sample_seed=i) for i, p in enumerate(params)]
    sampled = sample(logits, SamplingBatch.build(requests, vocab, torch.device("cpu")))
    second = logits[1].clone()
    second[top[1]] -= 100.0
    assert sampled.tolist() == [favoured, int(second.argmax()), int(top[2])]


def test_uniform_noise_is_strictly_inside_0_1() -> None:
    """The extreme bit patterns map inside (0, 1) in float32, so the Gumbel noise is finite."""
    from mlaserve.kernels.sampling import uniform_from_bits

    extremes = torch.tensor([0, -1, (1 << 63) - 1, -(1 << 63), 1 << 41], dtype=torch.int64)
    u = uniform_from_bits(extremes)
    assert ((u > 0) & (u < 1)).all(), u
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
