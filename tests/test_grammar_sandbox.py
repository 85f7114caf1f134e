"""The grammar sandbox and the engine's compiles: a first compile runs in a worker process with a
time budget and a memory cap, small constraints never wait behind large ones, a compile whose
requests are gone is cancelled, and compiled grammars are kept within a byte budget."""

import json

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.engine.grammar_sandbox import GrammarSandbox
from mlaserve.engine.grammars import GrammarKey
from mlaserve.engine.messages import EngineCoreRequest
from mlaserve.engine.request import StructuredOutputs
from mlaserve.engine.structured_config import StructuredOutputsConfig
from tests.conftest import DEMO_VOCAB

# about a second to compile on a 2-core machine and ~100 MB (the demo tokenizer): a large
# constraint that is slow but allowed where the limits let it through
MANY_CHOICES = [f"choice-{i}" for i in range(40_000)]
LOOSE = {"max_alternatives": 10**6, "max_bytes": 2**24}


@pytest.fixture(scope="module")
def tokenizer_info_json(checkpoint_dir) -> str:
    import xgrammar as xgr

    from mlaserve.engine.tokenizer import load_tokenizer

    path, _ = checkpoint_dir("v3-random-demo-vocab")
    tokenizer = load_tokenizer(str(path))
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=DEMO_VOCAB,
                                              stop_token_ids=[1]).serialize_json()


def choice_key(choices: list[str]) -> GrammarKey:
    return GrammarKey("choice", json.dumps(choices), True)


def test_a_trial_past_its_time_budget_is_killed_and_named(tokenizer_info_json):
    sandbox = GrammarSandbox(tokenizer_info_json, StructuredOutputsConfig(
        compile_timeout_s=0.2, **LOOSE))
    try:
        exc = sandbox.trial(choice_key(MANY_CHOICES)).exception(timeout=120)
        message = sandbox.failure_message(exc)
        assert "compile_timeout_s" in message and "0.2 s" in message, message
        # the lane's worker was replaced: it compiles the next one
        assert sandbox.trial(choice_key(["a"] * 2000)).result(timeout=120).seconds < 0.2
    finally:
        sandbox.shutdown()


def test_a_trial_past_its_memory_cap_fails_and_the_worker_goes_on(tokenizer_info_json):
    sandbox = GrammarSandbox(tokenizer_info_json, StructuredOutputsConfig(
        compile_memory_mb=48, **LOOSE))
    try:
        exc = sandbox.trial(choice_key(MANY_CHOICES)).exception(timeout=120)
        message = sandbox.failure_message(exc)
        assert isinstance(exc, MemoryError) and "compile_memory_mb" in message, message
        invalid = sandbox.trial(GrammarKey("regex", "a(b", True)).exception(timeout=120)
        assert "structured_outputs.regex is invalid" in sandbox.failure_message(invalid)
        small = sandbox.trial(choice_key(["yes", "no"])).result(timeout=120)
        assert small.memory_bytes > 0
    finally:
        sandbox.shutdown()


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    path, _ = checkpoint_dir("v3-random-demo-vocab")
    instance = LLM(str(path), device="cpu", num_kv_blocks=256, block_size=16,
                   structured_outputs_config={"cache_mb": 1, **LOOSE})
    yield instance
    instance.shutdown()


def choice_params(choices: list[str], max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0,
                          structured_outputs=StructuredOutputs(choice=choices))


def run(core, until) -> dict:
    """Step the core until `until(finished)` holds; the finished outputs by request id."""
    finished: dict = {}
    while not until(finished):
        finished.update({o.request_id: o for o in core.step() if o.finish_reason is not None})
    return finished


def test_a_small_constraint_never_waits_behind_a_large_one(llm):
    core = llm.engine.core
    # start both lanes' workers first, so that only the compiles race
    llm.generate(["x", "x"], [choice_params(["warm"]), choice_params(["w"] * 3000)])
    core.add_request(EngineCoreRequest("large", [5, 6], choice_params(MANY_CHOICES), 0))
    core.add_request(EngineCoreRequest("small", [5, 6], choice_params(["yes", "no"]), 0))
    finished = run(core, lambda done: "small" in done)
    assert finished["small"].error is None
    assert core.structured.is_compiling("large")  # still in its own lane
    finished = run(core, lambda done: "large" in done)
    assert finished["large"].error is None


def test_a_compile_whose_requests_are_gone_is_cancelled(llm):
    core, structured = llm.engine.core, llm.engine.core.structured
    choices = MANY_CHOICES[:30_000]
    core.add_request(EngineCoreRequest("left-1", [5, 6], choice_params(choices), 0))
    core.add_request(EngineCoreRequest("left-2", [5, 6], choice_params(choices), 0))
    core.step()
    (job,) = structured._jobs.values()
    assert job.waiting == {"left-1", "left-2"}
    core.abort_requests(["left-1"])
    assert structured._jobs  # one request still waits for it
    core.abort_requests(["left-2"])
    assert not structured._jobs and job.stage.cancelled()
    assert not core.has_unfinished
    # the lane goes on with a new worker
    assert llm.generate(["x"], choice_params(["after"], max_tokens=8))[0].text == "after"


def test_compiled_grammars_are_kept_within_the_byte_budget(llm):
    structured = llm.engine.core.structured
    # each some hundred KB: a 1 MiB cache holds a few of them
    regexes = [f"[a-z]{{1,{400 + i}}}" for i in range(8)]
    for regex in regexes:
        params = SamplingParams(max_tokens=2, temperature=0,
                                structured_outputs=StructuredOutputs(regex=regex))
        llm.generate(["x"], params)
    assert 0 < structured.cache_bytes <= 2**20
    compiled = structured.num_compiled
    llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputs(
        regex=regexes[-1])))
    assert structured.num_compiled == compiled  # the latest is kept
    llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputs(
        regex=regexes[0])))
    assert structured.num_compiled == compiled + 1  # the oldest was evicted


def test_min_tokens_ends_where_the_grammar_must_end(llm):
    """A constraint complete before min_tokens ends the request with "stop" (its grammar's
    end), instead of leaving it no allowed token; EOS and ignore_eos alike."""
    for ignore_eos in (False, True):
        for constraint in (StructuredOutputs(choice=["ab"]), StructuredOutputs(regex="a"),
                           StructuredOutputs(json='{"enum": [1]}')):
            params = SamplingParams(max_tokens=8, min_tokens=5, temperature=1.0, n=2,
                                    ignore_eos=ignore_eos, structured_outputs=constraint)
            (out,) = llm.generate(["Hello"], params)
            for sample in out.samples:
                assert sample.finish_reason == "stop", sample
                assert sample.text in ("ab", "a", "1")
