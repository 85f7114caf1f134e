"""Engine behaviour with exact expectations: batching, chunking, prefix caching, preemption."""

import random
from dataclasses import replace

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.engine.engine import StepFailed

rng = random.Random(1)
PROMPTS = [[rng.randrange(4, 450) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
SHARED = [rng.randrange(4, 450) for _ in range(48)]
PREFIXED = [SHARED + [rng.randrange(4, 450) for _ in range(rng.randrange(1, 9))]
            for _ in range(5)]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def llm(**kwargs):
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("block_size", 16)
    return LLM(device="cpu", **kwargs)


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of each prompt run alone, prefix caching off."""
    engine = llm(enable_prefix_caching=False)
    return {tuple(p): engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS + PREFIXED}


def ids(outputs):
    return [o.token_ids for o in outputs]


def test_all_at_once_equals_one_by_one(reference):
    outs = llm().generate(PROMPTS + PREFIXED, GREEDY)
    assert ids(outs) == [reference[tuple(p)] for p in PROMPTS + PREFIXED]


def test_chunked_prefill_under_a_small_token_budget(reference):
    engine = llm(max_num_batched_tokens=7, enable_prefix_caching=False)
    outs = engine.generate(PROMPTS, GREEDY)
    assert ids(outs) == [reference[tuple(p)] for p in PROMPTS]


def test_prompt_logprobs_of_chunked_prefills_score_their_own_tokens():
    """A prompt prefilled over several steps: every entry holds the logprob of the prompt token
    it is for, equal to the one-chunk run's (the pipelined steps land a chunk's entries only
    after the next chunk has launched)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    whole = llm(enable_prefix_caching=False).generate(PROMPTS[:4], params)
    chunked = llm(max_num_batched_tokens=7, enable_prefix_caching=False).generate(
        PROMPTS[:4], params)
    for prompt, want, got in zip(PROMPTS, whole, chunked, strict=False):
        assert len(got.prompt_logprobs) == len(prompt)
        for token, want_entry, got_entry in zip(prompt[1:], want.prompt_logprobs[1:],
                                                got.prompt_logprobs[1:], strict=True):
            assert got_entry.keys() == {token}
            assert got_entry[token] == pytest.approx(want_entry[token], abs=1e-4)


def test_prefix_caching_reuses_blocks_and_changes_nothing(reference):
    engine = llm(enable_prefix_caching=True)
    first = engine.generate([PREFIXED[0]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    outs = engine.generate(PREFIXED[1:], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [48] * 4  # three shared 16-token blocks
    assert ids(outs) == [reference[tuple(p)] for p in PREFIXED[1:]]
    pool = engine.engine.pool
    assert pool.num_hits == 4 * 48


def test_a_shared_prefix_arriving_together_is_computed_once(reference):
    """Prompts sharing 48 tokens arrive in one batch (as the n samples of one prompt do): the
    first computes the shared blocks, the others wait a step and take them from the cache."""
    engine = llm(enable_prefix_caching=True)
    outs = engine.generate(PREFIXED, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0] + [48] * 4
    assert ids(outs) == [reference[tuple(p)] for p in PREFIXED]
    # with a small token budget the shared blocks take several steps: still computed once
    engine = llm(enable_prefix_caching=True, max_num_batched_tokens=20)
    outs = engine.generate(PREFIXED, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0] + [48] * 4
    assert ids(outs) == [reference[tuple(p)] for p in PREFIXED]


def test_tiny_pool_forces_preemption_and_changes_nothing(reference):
    engine = llm(num_kv_blocks=16, block_size=4, enable_prefix_caching=False)
    outs = engine.generate(PROMPTS, GREEDY)
    assert engine.engine.scheduler.num_preemptions > 0
    assert ids(outs) == [reference[tuple(p)] for p in PROMPTS]
    assert engine.engine.pool.num_free_blocks == 16


def test_seeded_sampling_is_identical_across_batch_compositions():
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234,
                            ignore_eos=True)
    engine = llm()
    alone = engine.generate([PROMPTS[0]], params)[0].token_ids
    mixed = engine.generate(PROMPTS[:5], [params] + [SamplingParams(
        max_tokens=9, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)])[0].token_ids
    assert alone == mixed
    other_seed = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=99,
                                ignore_eos=True)
    assert engine.generate([PROMPTS[0]], other_seed)[0].token_ids != alone


def test_stop_strings_and_stop_token_ids():
    engine = llm()
    base = engine.generate([PROMPTS[2]], GREEDY)[0]
    text = base.text
    stop = text[5:8]
    cut = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0,
                                                       ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    token = base.token_ids[3]
    first = base.token_ids.index(token)
    by_id = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0,
                                                         ignore_eos=True,  # as `base`
                                                         stop_token_ids=[token]))[0]
    assert by_id.token_ids == base.token_ids[: first + 1] and by_id.stop_reason == token


def test_requests_that_cannot_fit_are_value_errors():
    engine = llm(num_kv_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="cannot fit the KV cache"):
        engine.generate([[5] * 10], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="more than max_model_len=64"):
        engine.generate([[5] * 70])


def test_warm_up_runs_a_request_and_leaves_nothing_behind():
    llm = LLM(device="cpu", attention_backend="torch", num_kv_blocks=32, block_size=4)
    engine = llm.engine
    before = engine.core.step
    steps = []
    engine.core.step = lambda: steps.append(1) or before()
    engine.warm_up()
    assert len(steps) >= 2  # a prefill and a decode step ran
    assert not engine.requests and not engine.has_unfinished
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_request_that_fails_its_step_fails_alone_in_llm_engine(reference, monkeypatch):
    """StepFailed names the failed request and carries the step's outputs; the other requests
    carry on and end as they do alone."""
    engine = llm().engine
    launch = engine.runner.launch

    def launch_or_fail(plan, *args):
        if "bad" in plan.request_ids:
            raise RuntimeError("bad data")
        return launch(plan, *args)

    monkeypatch.setattr(engine.runner, "launch", launch_or_fail)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(prompt, replace(GREEDY, output_kind="final_only"), f"ok-{i}")
    engine.add_request(PROMPTS[4], GREEDY, "bad")
    finals, failures = {}, []
    while engine.has_unfinished:
        try:
            outputs = engine.step()
        except StepFailed as exc:
            failures.append(exc)
            outputs = exc.outputs
        finals.update({o.request_id: o for o in outputs if o.finished})
    assert [f.request_ids for f in failures] == [["bad"]] and "bad data" in str(failures[0])
    assert finals["bad"].finish_reason == "abort" and finals["bad"].token_ids == []
    assert [finals[f"ok-{i}"].token_ids for i in range(4)] == [reference[tuple(p)]
                                                              for p in PROMPTS[:4]]
