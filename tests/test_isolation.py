"""One request never hurts another: hostile sampling parameters are refused at the door or run
without touching the innocent requests beside them, and a step that fails because of one request
fails that request only (the engine core on the demo model, CPU, float32)."""

import json
from dataclasses import dataclass, field

import msgspec
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import mlaserve.engine.runner as runner_module
from mlaserve.engine.args import DEMO_MODEL_DIR, EngineArgs
from mlaserve.engine.core import EngineCore
from mlaserve.engine.messages import EngineCoreRequest
from mlaserve.engine.request import OUTPUT_KINDS, SamplingParams
from mlaserve.engine.sampler import SamplingBatch

VOCAB = json.loads((DEMO_MODEL_DIR / "config.json").read_text())["vocab_size"]
MAX_MODEL_LEN = 64
ARGS = EngineArgs(device="cpu", num_kv_blocks=96, block_size=8, max_model_len=MAX_MODEL_LEN,
                  max_num_seqs=16)
PROMPTS = [[(17 * i + 5 * j) % 400 + 4 for j in range(3 + 2 * i)] for i in range(10)]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(ARGS)


@pytest.fixture(scope="module")
def alone(core) -> list[list[int]]:
    """Each innocent prompt's greedy tokens, run alone."""
    return [run(core, [innocent(i)])[f"innocent-{i}"].token_ids for i in range(len(PROMPTS))]


def innocent(i: int) -> EngineCoreRequest:
    return EngineCoreRequest(f"innocent-{i}", PROMPTS[i], GREEDY, sample_seed=i)


def run(core: EngineCore, requests: list[EngineCoreRequest], added: list[str] = ()
        ) -> dict[str, Result]:
    """Add the requests and step until the core is idle; the result of each of them and of
    the requests named in `added` (added before)."""
    for request in requests:
        core.add_request(request)
    results = {request_id: Result() for request_id in [*added, *(r.request_id for r in requests)]}
    while core.has_unfinished:
        for output in core.step():
            result = results[output.request_id]
            assert result.finish_reason is None, "an output after the request finished"
            result.token_ids += output.new_token_ids
            result.finish_reason, result.stop_reason = output.finish_reason, output.stop_reason
            result.error = output.error
    assert_idle(core)
    return results


def assert_idle(core: EngineCore) -> None:
    """The core holds no request and no KV block; the runner's rows are free but for the
    requests that the next plan tells it to drop."""
    assert not core.requests and not core.scheduler.has_unfinished
    assert core.pool.num_free_blocks == core.pool.num_blocks
    assert set(core.runner.requests) <= set(core.plans.leaving)
    assert len(core.runner.inputs.free_rows) + len(core.runner.requests) == ARGS.max_num_seqs


def assert_innocents_unharmed(results: dict[str, Result], alone: list[list[int]],
                              indices: range) -> None:
    for i in indices:
        result = results[f"innocent-{i}"]
        assert (result.token_ids, result.finish_reason, result.error) == (
            alone[i], "length", None), f"innocent-{i}"


# ---- validation at the door ----------------------------------------------------------------
HOSTILE_INTS = [2**63, 2**63 - 1, -(2**63), -(2**63) - 1, 2**64, 10**30, 10**5000, -1, -2, 0,
                True, False, 1.5, float("nan"), "3", None, [1]]
HOSTILE_FLOATS = [float("nan"), float("inf"), -float("inf"), 1e39, -1e39, 1e-40, 5e-324, 0.0,
                  -0.0, -1e-9, 2.0000001, 10**400, 3, True, "1", None]
HOSTILE_IDS = [-1, VOCAB, VOCAB - 1, 99999, 2**63, 2**64, True, 1.0]
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), max_size=4)
HOSTILE_TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1) | st.sampled_from(HOSTILE_IDS),
                             max_size=4) | st.sampled_from([5, "7", None, (3,)])
# (valid values, hostile values) of each field
FIELDS = {
    "max_tokens": (st.integers(1, 4), HOSTILE_INTS),
    "temperature": (st.floats(0, 2), HOSTILE_FLOATS),
    "top_p": (st.floats(0, 1, exclude_min=True), HOSTILE_FLOATS),
    "top_k": (st.integers(-1, VOCAB + 10), HOSTILE_INTS),
    "min_p": (st.floats(0, 1), HOSTILE_FLOATS),
    "seed": (st.integers(-(2**63), 2**63 - 1) | st.none(), HOSTILE_INTS),
    "stop_token_ids": (TOKEN_IDS, HOSTILE_TOKEN_IDS),
    "ignore_eos": (st.booleans(), [0, 1, "yes", None]),
    "logprobs": (st.integers(0, 20) | st.none(), HOSTILE_INTS + [21]),
    "prompt_logprobs": (st.integers(0, 20) | st.none(), HOSTILE_INTS + [21]),
    "presence_penalty": (st.floats(-2, 2), HOSTILE_FLOATS + [-2.5, 2.5]),
    "frequency_penalty": (st.floats(-2, 2), HOSTILE_FLOATS + [-2.5, 2.5]),
    "repetition_penalty": (st.floats(0.01, 3), HOSTILE_FLOATS),
    "min_tokens": (st.integers(0, 4), HOSTILE_INTS),
    "output_kind": (st.sampled_from(OUTPUT_KINDS), ["bogus", None, 3]),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3)
                   | st.none(),
                   [{VOCAB: 1.0}, {-1: 1.0}, {3: float("nan")}, {3: 101.0}, {"3": 1.0}, [3]]),
}


def hostile_values(value: object) -> st.SearchStrategy:
    return value if isinstance(value, st.SearchStrategy) else st.sampled_from(value)


@st.composite
def sampling_kwargs(draw) -> dict:
    """Valid values for some fields, then hostile ones for up to three of them."""
    kwargs = draw(st.fixed_dictionaries({}, optional={n: v for n, (v, _) in FIELDS.items()}))
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
        kwargs[name] = draw(hostile_values(FIELDS[name][1]))
    return kwargs


@settings(max_examples=40, deadline=None, database=None)
@given(kwargs=sampling_kwargs(), prompt=TOKEN_IDS.filter(bool) | HOSTILE_TOKEN_IDS,
       sample_seed=st.integers(0, 2**62) | st.sampled_from(HOSTILE_INTS))
def test_hostile_params_are_refused_or_run_without_touching_innocents(core, alone, kwargs,
                                                                      prompt, sample_seed):
    """Every hostile request is refused with a ValueError at the door or runs to a normal end,
    and three innocent greedy requests beside it get the tokens they get alone."""
    try:
        params = SamplingParams(**kwargs)
        hostile = EngineCoreRequest("hostile", prompt, params, sample_seed)
        core.add_request(hostile)
    except ValueError:
        assert_idle(core)
        hostile = None
        event("refused")
    else:
        # what the engine process would decode is what was sent
        wire = msgspec.msgpack.encode(hostile)
        assert msgspec.msgpack.decode(wire, type=EngineCoreRequest) == hostile
    results = run(core, [innocent(0), innocent(1), innocent(2)],
                  added=["hostile"] if hostile is not None else [])
    assert_innocents_unharmed(results, alone, range(3))
    if hostile is not None:
        event("ran")
        assert_ended_normally(results["hostile"], params, core.info.eos_token_ids)


def assert_ended_normally(result: Result, params: SamplingParams,
                          eos_token_ids: list[int]) -> None:
    """Finished by length, a stop token id or EOS, as its parameters allow, with no error."""
    assert result.error is None and result.finish_reason in ("stop", "length"), result
    tokens = result.token_ids
    assert 1 <= len(tokens) <= params.max_tokens and all(0 <= t < VOCAB for t in tokens)
    if result.finish_reason == "length":
        assert len(tokens) == params.max_tokens
        return
    assert len(tokens) >= max(params.min_tokens, 1)
    if result.stop_reason is not None:
        assert result.stop_reason == tokens[-1] and tokens[-1] in params.stop_token_ids
    else:
        assert not params.ignore_eos and tokens[-1] in eos_token_ids


def test_the_two_requests_of_the_brief_are_refused_naming_their_field(core):
    with pytest.raises(ValueError, match=r"top_k must be .* got 9223372036854775808"):
        SamplingParams(max_tokens=4, top_k=2**63)
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[99999])
    with pytest.raises(ValueError, match=rf"stop_token_ids must be in \[0, {VOCAB}\)"):
        core.add_request(EngineCoreRequest("beyond-vocab", [5, 6], params, sample_seed=0))
    assert_idle(core)


NAN, INF = float("nan"), float("inf")
REFUSED = [  # (parameters, what the message must say)
    ({"top_k": -2}, "top_k must be -1 or 0"),
    ({"top_k": 2**63}, "top_k must be"),
    ({"top_k": True}, "top_k must be"),
    ({"temperature": NAN}, r"temperature must be a finite number in \[0, "),
    ({"temperature": INF}, "temperature must be a finite number"),
    ({"temperature": -0.5}, "temperature must be"),
    ({"temperature": 1e39}, "temperature must be"),
    ({"top_p": 0.0}, r"top_p must be a finite number in \(0, 1\]"),
    ({"top_p": NAN}, "top_p must be"),
    ({"min_p": 1.5}, r"min_p must be a finite number in \[0, 1\]"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be a finite number in \[-2, 2\]"),
    ({"frequency_penalty": -INF}, "frequency_penalty must be"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty must be"),
    ({"repetition_penalty": INF}, "repetition_penalty must be"),
    ({"seed": 2**63}, r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"),
    ({"seed": -(2**63) - 1}, "seed must be"),
    ({"seed": 1.5}, "seed must be"),
    ({"max_tokens": 0}, "max_tokens must be"),
    ({"max_tokens": 10**5000}, "max_tokens must be .* got an integer of 16610 bits"),
    ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens must be an integer in \[0, 4\]"),
    ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be"),
    ({"stop_token_ids": [-1]}, "every stop_token_ids entry must be"),
    ({"stop_token_ids": [2**64]}, "every stop_token_ids entry must be"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"output_kind": "bogus"}, "output_kind must be one of"),
    ({"logit_bias": {3: 100.5}}, r"logit_bias\[3\] must be a finite number in \[-100, 100\]"),
    ({"logit_bias": {-1: 1.0}}, "every logit_bias key must be"),
    ({"logit_bias": [3]}, "logit_bias must map token ids to numbers"),
]


@pytest.mark.parametrize("kwargs,message", REFUSED)
def test_bad_parameters_are_value_errors_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,prompt,message", [
    ({"stop_token_ids": [VOCAB]}, [5], rf"stop_token_ids must be in \[0, {VOCAB}\)"),
    ({"logit_bias": {VOCAB: 5.0}}, [5], rf"logit_bias keys must be token ids in \[0, {VOCAB}\)"),
    ({}, [5, VOCAB], rf"prompt token ids must be integers in \[0, {VOCAB}\)"),
    ({}, [5, True], "prompt token ids must be integers"),
    ({}, [], "the prompt is empty"),
    ({"max_tokens": 60}, [5] * 8, "exceeds max_model_len=64"),
])
def test_requests_the_model_cannot_serve_are_value_errors(core, kwargs, prompt, message):
    request = EngineCoreRequest("bad", prompt, SamplingParams(**kwargs), sample_seed=0)
    with pytest.raises(ValueError, match=message):
        core.add_request(request)
    with pytest.raises(ValueError, match="sample_seed must be a 64-bit integer"):
        core.add_request(EngineCoreRequest("bad", [5], SamplingParams(), sample_seed=2**64))
    assert_idle(core)


def test_a_tiny_temperature_is_raised_to_one_hundredth():
    assert SamplingParams(temperature=1e-30).temperature == 0.01
    assert SamplingParams(temperature=0).temperature == 0


def test_top_k_above_the_vocabulary_keeps_every_token(core):
    """Accepted and clamped to the vocabulary: the same tokens as top_k = vocabulary size."""
    def sampled(top_k: int) -> list[int]:
        params = SamplingParams(max_tokens=6, temperature=1.0, top_k=top_k, ignore_eos=True)
        return run(core, [EngineCoreRequest("r", PROMPTS[3], params, 7)])["r"].token_ids

    assert sampled(2**63 - 1) == sampled(VOCAB)


# ---- a step that fails -----------------------------------------------------------------------
POISON_SEED = 666


def poisoned_request(first_bad_output: int) -> tuple[EngineCoreRequest, int]:
    """A request that will make the sampler raise, and the first position it may not sample."""
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    return EngineCoreRequest("poisoned", PROMPTS[4], params, sample_seed=POISON_SEED), (
        len(PROMPTS[4]) + first_bad_output)


def poison_sampler(monkeypatch: pytest.MonkeyPatch, bad_position: int = 0) -> list[int]:
    """Make the runner's sampler raise IndexError("poisoned row") whenever a row seeded with
    POISON_SEED samples position `bad_position` or later; returns the list that collects the
    row count of each failed call."""
    sample = runner_module.sample
    failures: list[int] = []

    def poisonable_sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if ((batch.seeds == POISON_SEED) & (batch.positions >= bad_position)).any():
            failures.append(len(logits))
            raise IndexError("poisoned row")
        return sample(logits, batch)

    monkeypatch.setattr(runner_module, "sample", poisonable_sample)
    return failures


@pytest.mark.parametrize("first_bad_output", [0, 2])
def test_a_request_that_breaks_its_step_fails_alone(core, alone, monkeypatch, first_bad_output):
    """The sampler raises whenever the poisoned request samples its token number
    `first_bad_output` or later (at its prefill, or mid-decode with a step in flight): it fails
    with that error after the tokens it had, and ten innocent requests finish unchanged."""
    request, bad_position = poisoned_request(first_bad_output)
    failures = poison_sampler(monkeypatch, bad_position)
    results = run(core, [innocent(i) for i in range(5)] + [request]
                  + [innocent(i) for i in range(5, 10)])
    assert_innocents_unharmed(results, alone, range(10))
    poisoned = results["poisoned"]
    assert (poisoned.finish_reason, poisoned.error) == ("abort", "IndexError: poisoned row")
    assert len(poisoned.token_ids) == first_bad_output
    # found by bisection: the full step, then one half per level down to the request alone
    assert failures[-1] == 1 and len(failures) <= 1 + 4


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_fault_that_does_not_repeat_fails_no_request(core, alone, monkeypatch, where):
    """A step of eleven requests fails once (at launch, or when collected with the next step
    already launched on its samples): it is taken back and re-run, and every request finishes
    as it does alone."""
    original = getattr(core.runner, where)
    calls = []

    def fail_third_call(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("transient fault")
        return original(*args)

    monkeypatch.setattr(core.runner, where, fail_third_call)
    results = run(core, [innocent(i) for i in range(10)] + [
        EngineCoreRequest("seeded", PROMPTS[4], SamplingParams(
            max_tokens=6, temperature=1.0, top_p=0.9, ignore_eos=True), sample_seed=3)])
    assert len(calls) > 3
    assert_innocents_unharmed(results, alone, range(10))
    monkeypatch.setattr(core.runner, where, original)
    seeded_alone = run(core, [EngineCoreRequest("seeded", PROMPTS[4], SamplingParams(
        max_tokens=6, temperature=1.0, top_p=0.9, ignore_eos=True), sample_seed=3)])
    assert results["seeded"] == seeded_alone["seeded"]


def test_a_broken_engine_fails_every_request_and_recovers_nothing_else(core, alone,
                                                                       monkeypatch):
    """Every step fails (as after a device fault): all requests fail with the error and the
    core is left holding nothing; once steps work again, a request runs as it did alone."""
    launch = core.runner.launch
    launches = []

    def broken(plan, *args):
        launches.append(1)
        if len(launches) > 2:
            raise RuntimeError("device lost")
        return launch(plan, *args)

    monkeypatch.setattr(core.runner, "launch", broken)
    results = run(core, [innocent(i) for i in range(8)])
    for i in range(8):
        result = results[f"innocent-{i}"]
        assert (result.finish_reason, result.error) == ("abort", "RuntimeError: device lost")
        assert result.token_ids == alone[i][: len(result.token_ids)]
    monkeypatch.setattr(core.runner, "launch", launch)
    assert run(core, [innocent(9)])["innocent-9"].token_ids == alone[9]


def test_an_innocent_is_not_failed_when_the_culprit_finished_meanwhile(core, alone,
                                                                         monkeypatch):
    """The culprit stops on a stop token in step N - 1 while step N (holding its wasted row) fails
    at launch: the innocent left alone in the failed step is re-run, not failed."""
    stop_token = alone[6][1]
    assert stop_token != alone[6][0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                            stop_token_ids=[stop_token])
    culprit = EngineCoreRequest("culprit", PROMPTS[6], params, sample_seed=POISON_SEED)
    bad_position = len(PROMPTS[6]) + 2  # the row after its stop token, sampled a step late
    failures = poison_sampler(monkeypatch, bad_position)
    results = run(core, [culprit, innocent(7)])
    assert failures == [2]
    assert results["culprit"].token_ids == alone[6][:2]
    assert results["culprit"].finish_reason == "stop"
    assert_innocents_unharmed(results, alone, [7])


def test_llm_generate_returns_every_result_when_one_prompt_fails(monkeypatch):
    """Offline: the prompt that breaks its step fails alone; generate finishes the others and
    then raises StepFailed carrying every output in input order."""
    from mlaserve.engine.engine import StepFailed
    from mlaserve.llm import LLM

    llm = LLM(device="cpu", num_kv_blocks=64, block_size=16, max_model_len=64)
    prompts = [PROMPTS[i] for i in range(4)]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = [out.token_ids for out in llm.generate(prompts, greedy)]
    poison_sampler(monkeypatch)
    poisoned = SamplingParams(max_tokens=4, temperature=1.0, seed=POISON_SEED, ignore_eos=True)
    with pytest.raises(StepFailed) as failed:
        llm.generate(prompts[:2] + [PROMPTS[5]] + prompts[2:], [greedy] * 2 + [poisoned]
                     + [greedy] * 2)
    outputs = failed.value.outputs
    assert [out.token_ids for i, out in enumerate(outputs) if i != 2] == expected
    assert outputs[2].finish_reason == "abort" and outputs[2].token_ids == []
    assert list(failed.value.errors.values()) == ["IndexError: poisoned row"]
