"""Structured outputs in the engine (grammar-constrained sampling with xgrammar).

A random-weight checkpoint over the demo tokenizer, so every constraint below holds by
construction only: the grammar's token mask is all that keeps the samples valid.
"""

import json
import re

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.engine.messages import EngineCoreRequest
from mlaserve.engine.request import StructuredOutputs
from mlaserve.engine.sampler import RowParams, SamplingBatch, sample
from mlaserve.engine.structured import apply_token_bitmask

SEEDS = range(6)
PROMPTS = ["The latent cache holds", "Hello", "A list of", "{"]

SCHEMA = {
    "type": "object",
    "properties": {
        # xgrammar 0.2.9 lets a length-bounded string ({"maxLength": 5}) hold raw control
        # characters, which strict JSON parsers refuse; a pattern keeps it to strict JSON
        "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "integer", "minimum": 1000, "maximum": 9999},
                           "primary": {"type": "boolean"}},
            "required": ["zip", "primary"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    path, _ = checkpoint_dir("v3-random-demo-vocab")
    return LLM(str(path), device="cpu", num_kv_blocks=256, block_size=16)


def token_id(llm, text: str) -> int:
    ids = llm.tokenizer.convert_tokens_to_ids([text])
    assert ids[0] is not None and ids[0] != llm.tokenizer.unk_token_id
    return ids[0]


def constrained(seed: int, max_tokens: int = 96, **kwargs) -> SamplingParams:
    extra = {k: kwargs.pop(k) for k in ("logit_bias", "ignore_eos", "top_k", "top_p")
             if k in kwargs}
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                          structured_outputs=StructuredOutputs(**kwargs), **extra)


def check_schema(value: object) -> None:
    try:
        import jsonschema_rs
    except ImportError:
        jsonschema_rs = None
    if jsonschema_rs is not None:
        jsonschema_rs.validate(SCHEMA, value)
    assert isinstance(value, dict) and set(value) <= set(SCHEMA["properties"])
    assert re.fullmatch("[a-z]{1,5}", value["name"])
    assert isinstance(value["age"], int) and 18 <= value["age"] <= 99
    assert value["role"] in ("admin", "user", "guest")
    assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b", "c"}
    assert 1000 <= value["address"]["zip"] <= 9999
    assert isinstance(value["address"]["primary"], bool)


def test_json_schema_samples_validate(llm):
    """Sampled at temperature 1 (plain, top-k and top-p paths), every output is a complete
    object that validates against a nested schema; the grammar's end stops the request."""
    # ~110 characters; the demo tokenizer (trained on arithmetic text) spends about a token
    # per character on JSON
    params = [constrained(seed, max_tokens=192, json=json.dumps(SCHEMA),
                          disable_any_whitespace=True,
                          **({"top_k": 50} if seed % 3 == 1 else {"top_p": 0.9} if seed % 3 == 2
                             else {}))
              for seed in SEEDS]
    outputs = llm.generate([PROMPTS[s % len(PROMPTS)] for s in SEEDS], params)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        check_schema(json.loads(out.text))
    assert len({o.text for o in outputs}) > 1  # sampled, not one fixed path


def test_regex_choice_and_json_object(llm):
    regex = r"[a-z]{2,4}-\d{2}(\.[A-Z])?"
    choices = ["yes", "no", "maybe so", 'a "quoted" one']
    quote, close = token_id(llm, '"'), token_id(llm, "}")
    params = ([constrained(s, regex=regex) for s in SEEDS]
              + [constrained(s, choice=choices, ignore_eos=True) for s in SEEDS]
              # biased towards short strings and closing braces so that random weights end
              + [constrained(s, json_object=True, disable_any_whitespace=True,
                             logit_bias={quote: 6.0, close: 6.0}) for s in SEEDS])
    outputs = llm.generate(["Hello"] * len(params), params)
    n = len(SEEDS)
    for out in outputs[:n]:
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text
    for out in outputs[n: 2 * n]:
        # ignore_eos: the grammar's end (not EOS) finished it
        assert out.finish_reason == "stop" and out.text in choices, out.text
    assert len({o.text for o in outputs[n: 2 * n]}) > 1
    for out in outputs[2 * n:]:
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict), out.text


def test_constrained_rows_leave_the_others_unchanged(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    mixed_params = [greedy, constrained(0, regex=r"[0-9]{12}"), greedy,
                    constrained(1, choice=["left", "right"]), greedy, greedy]
    mixed_prompts = [PROMPTS[0], "x", PROMPTS[1], "y", PROMPTS[2], PROMPTS[3]]
    outputs = llm.generate(mixed_prompts, mixed_params)
    assert [outputs[i].token_ids for i in (0, 2, 4, 5)] == alone
    assert re.fullmatch(r"[0-9]{12}", outputs[1].text) and outputs[3].text in ("left", "right")
    # greedy under a constraint is the best allowed token
    greedy_regex = SamplingParams(max_tokens=12, temperature=0,
                                  structured_outputs=StructuredOutputs(regex=r"[0-9]{5}"))
    assert re.fullmatch(r"[0-9]{5}", llm.generate(["x"], greedy_regex)[0].text)


def test_after_token_id_holds_the_constraint_back(llm):
    """Free sampling (here pushed to the trigger by logit_bias) until the trigger token is
    generated; from the next token on, the grammar rules (and overrides the bias)."""
    trigger = token_id(llm, "!")
    outputs = llm.generate(["Hello"] * 4, [
        constrained(s, choice=["yes", "no"], after_token_id=trigger, logit_bias={trigger: 100.0})
        for s in range(4)])
    for out in outputs:
        assert out.token_ids[0] == trigger
        assert out.finish_reason == "stop" and out.text[1:] in ("yes", "no"), out.text
    # without the trigger, nothing is constrained: the biased token repeats until max_tokens
    free = llm.generate(["Hello"], constrained(0, max_tokens=5, choice=["yes"],
                                               after_token_id=trigger + 1,
                                               logit_bias={trigger: 100.0}))[0]
    assert free.token_ids == [trigger] * 5 and free.finish_reason == "length"


@pytest.mark.parametrize("kind,value,fragment", [
    ("json", '{"type": "frobnicate"}', "frobnicate"),
    ("json", "{not json", "JSON"),
    ("regex", "a(b", "parenthesis"),
    ("grammar", "root ::= undefined_rule", "undefined_rule"),
])
def test_invalid_constraint_is_refused_naming_it(llm, kind, value, fragment):
    """`LLMEngine.add_request` raises (a constraint compiles before it returns); the core itself
    refuses the request at its next step, the output marked `rejected` (a server's 400)."""
    params = SamplingParams(structured_outputs=StructuredOutputs(**{kind: value}))
    with pytest.raises(ValueError, match=f"structured_outputs.{kind}") as info:
        llm.engine.add_request("Hello", params)
    assert fragment in str(info.value)
    assert not llm.engine.has_unfinished
    core, request_id = llm.engine.core, f"bad-{kind}-{fragment}"
    core.add_request(EngineCoreRequest(request_id, [5, 6], params, 0))
    outputs = []
    while core.has_unfinished:
        outputs += core.step()
    (refused,) = [o for o in outputs if o.request_id == request_id]
    assert refused.rejected and refused.finish_reason == "abort" and not refused.new_token_ids
    assert f"structured_outputs.{kind}" in refused.error and fragment in refused.error


def test_after_token_id_outside_the_vocabulary(llm):
    params = SamplingParams(structured_outputs=StructuredOutputs(regex="a", after_token_id=10**6))
    with pytest.raises(ValueError, match="after_token_id"):
        llm.generate(["Hello"], params)


def test_same_constraint_compiles_once(llm):
    manager = llm.engine.core.structured
    before = manager.num_compiled
    params = [constrained(s, regex=r"once-[xyz]{3}") for s in range(3)]
    outputs = llm.generate(["Hello"] * 3, params)
    outputs += llm.generate(["Hello"], constrained(7, regex=r"once-[xyz]{3}"))
    assert all(re.fullmatch(r"once-[xyz]{3}", o.text) for o in outputs)
    assert manager.num_compiled == before + 1


def test_a_request_waiting_for_its_grammar_holds_up_no_one(llm):
    """While one request's grammar "compiles", the requests behind it run; it keeps its place."""
    engine, core = llm.engine, llm.engine.core
    compiling = {"slow"}
    core.scheduler.waits_for_grammar = lambda r: r.request_id in compiling
    try:
        engine.add_request("Hello", constrained(0, regex="[ab]{4}"), request_id="slow")
        engine.add_request("Hello", SamplingParams(max_tokens=3, ignore_eos=True),
                           request_id="fast")
        finished = {}
        while "fast" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert "slow" not in finished and core.scheduler.waiting[0].request_id == "slow"
        compiling.clear()
        while engine.has_unfinished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert re.fullmatch("[ab]{4}", finished["slow"].text)
    finally:
        core.scheduler.waits_for_grammar = core.structured.waits_for_grammar


def test_bitmask_applies_to_every_sampling_path():
    """Only allowed tokens of constrained rows are sampled (greedy, Gumbel, top-k/top-p);
    unconstrained rows see their logits untouched. Matches xgrammar's own kernel."""
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    n, vocab = 6, 100
    logits = torch.randn(n, vocab, generator=gen) * 3
    rows = torch.tensor([1, 3, 4])
    allowed_ids = [[7, 50, 99], [0], list(range(10, 20))]
    bitmask = torch.zeros(3, 4, dtype=torch.int32)
    for i, ids in enumerate(allowed_ids):
        for t in ids:
            bitmask[i, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    masked = apply_token_bitmask(logits, rows, bitmask)
    expected, full = logits.clone(), torch.full((n, 4), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full)
    assert torch.equal(masked, expected)
    assert torch.equal(masked[[0, 2, 5]], logits[[0, 2, 5]])
    for temperature, top_k, top_p in [(0.0, vocab, 1.0), (1.0, vocab, 1.0), (1.0, 5, 0.9)]:
        for seed in range(5):
            batch = SamplingBatch(
                RowParams(temperature=torch.full((n,), temperature),
                          top_k=torch.full((n,), top_k), top_p=torch.full((n,), top_p),
                          min_p=torch.zeros(n), seeds=torch.full((n,), seed)),
                rows=None, positions=torch.arange(n),
                all_greedy=temperature == 0, needs_filter=top_k < vocab or top_p < 1,
                allowed=(rows, bitmask))
            tokens = sample(logits, batch).tolist()
            for row, ids in zip(rows.tolist(), allowed_ids, strict=True):
                assert tokens[row] in ids
            if temperature == 0:
                assert [tokens[i] for i in (0, 2, 5)] == logits[[0, 2, 5]].argmax(-1).tolist()


def test_a_grammar_that_fails_to_compile_fails_only_its_request(llm, monkeypatch):
    """A compile that fails here (after its sandbox trial passed) refuses its request alone."""
    core = llm.engine.core

    def broken(key):
        raise RuntimeError("no memory for the token mask cache")

    monkeypatch.setattr(core.structured, "_compile", broken)
    core.add_request(EngineCoreRequest("broken", [5, 6], constrained(0, regex="never-compiled"),
                                       0))
    core.add_request(EngineCoreRequest("ok", [5, 6], SamplingParams(max_tokens=3,
                                                                    ignore_eos=True), 0))
    outputs = []
    while core.has_unfinished:
        outputs += core.step()
    (broken_out,) = [o for o in outputs if o.request_id == "broken"]
    assert broken_out.rejected and "token mask cache" in broken_out.error
    assert len([t for o in outputs if o.request_id == "ok" for t in o.new_token_ids]) == 3
    with pytest.raises(ValueError, match="token mask cache"):
        llm.engine.add_request("Hello", constrained(0, regex="never-compiled-2"))
    assert not llm.engine.has_unfinished


def test_extreme_noise_never_picks_a_masked_token(monkeypatch):
    """A uniform draw of exactly 1 (float32 rounding) makes the Gumbel noise +inf; a masked
    logit (-inf) plus it is NaN, which argmax would pick. The sampler keeps the row allowed."""
    import mlaserve.engine.sampler as sampler
    import mlaserve.kernels.sampling as kernels

    def ones(seeds, positions, vocab):
        return torch.ones(seeds.shape[0], vocab)

    monkeypatch.setattr(kernels, "seeded_uniform", ones)
    monkeypatch.setattr(sampler, "seeded_uniform", ones)
    n, vocab = 2, 64
    logits = torch.zeros(n, vocab)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    for top_k in (vocab, 5):
        batch = SamplingBatch(
            RowParams(temperature=torch.ones(n), top_k=torch.full((n,), top_k),
                      top_p=torch.ones(n), min_p=torch.zeros(n),
                      seeds=torch.zeros(n, dtype=torch.int64)),
            rows=None, positions=torch.zeros(n, dtype=torch.int64), all_greedy=False,
            needs_filter=top_k < vocab, allowed=(torch.tensor([1]), bitmask))
        assert sample(logits, batch)[1].item() == 35


def test_json_whitespace_is_compact_by_default_and_bounded_when_allowed():
    """The server's default (None at the door -> its config, compact) gives OpenAI's compact
    JSON; allowing whitespace bounds each run to MAX_WHITESPACE_RUN."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from mlaserve.engine.grammars import MAX_WHITESPACE_RUN, grammar_key, parse_grammar
    from mlaserve.engine.structured import validate_structured_outputs
    from mlaserve.engine.structured_config import StructuredOutputsConfig

    schema = json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}},
        "required": ["a", "b"]})
    default = StructuredOutputs(json=schema)
    validate_structured_outputs(default, 512, StructuredOutputsConfig())
    assert default.disable_any_whitespace is True
    compact = parse_grammar(grammar_key(default))
    assert accepts(compact, '{"a":1,"b":["x","y"]}')
    for spaced in ('{"a": 1,"b":["x"]}', '{"a":1, "b":["x"]}', '{ "a":1,"b":[]}',
                   '{"a":1,"b":["x"]}\n'):
        assert not accepts(compact, spaced), spaced

    allowed = StructuredOutputs(json=schema)
    validate_structured_outputs(allowed, 512,
                                StructuredOutputsConfig(disable_any_whitespace=False))
    assert allowed.disable_any_whitespace is False
    spaced = parse_grammar(grammar_key(allowed))
    run = " " * MAX_WHITESPACE_RUN
    assert accepts(spaced, '{\n  "a": 1,\n  "b": [ "x" ]\n}')
    assert accepts(spaced, '{' + run + '"a":1,"b":[]}')
    assert not accepts(spaced, '{' + run + ' "a":1,"b":[]}')

    explicit = StructuredOutputs(json=schema, disable_any_whitespace=False)
    validate_structured_outputs(explicit, 512, StructuredOutputsConfig())
    assert explicit.disable_any_whitespace is False  # the request's own choice stands
    with pytest.raises(ValueError, match="disable_any_whitespace must be true or false"):
        StructuredOutputsConfig(disable_any_whitespace="yes")
