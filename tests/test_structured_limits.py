"""What a constraint may cost, checked before anything parses it (structured_config.py), and how
the limits are set (`--structured-outputs-config`, EngineArgs)."""

import json

import pytest

from mlaserve.cli import build_parser, engine_args_from
from mlaserve.engine.args import EngineArgs
from mlaserve.engine.messages import EngineInfo, validate_prompt
from mlaserve.engine.request import SamplingParams, StructuredOutputs
from mlaserve.engine.structured_config import (
    ConstraintLimitError,
    StructuredOutputsConfig,
    check_limits,
    json_depth,
)

SMALL = StructuredOutputsConfig(max_bytes=4096, max_json_depth=8, max_alternatives=20,
                                max_grammar_rules=5)


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}  # a bracket a level
    return schema


@pytest.mark.parametrize("text,depth", [
    ("1", 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4),
    ('{"a": "[[[[{{{{"}', 1),  # brackets inside strings do not count
    ('{"a": "\\"[[[", "b": [[]]}', 3),  # nor after an escaped quote
    ("[" * 5000 + "]" * 5000, 5000),  # no recursion
])
def test_json_depth_counts_brackets_outside_strings(text, depth):
    assert json_depth(text) == depth


@pytest.mark.parametrize("kind,spec,limit", [
    ("json", json.dumps({"enum": ["x" * 5000]}), "max_bytes"),
    ("json", json.dumps(nested(8)), "max_json_depth"),  # 9 deep
    ("json", json.dumps({"enum": list(range(15)), "anyOf": [{}] * 6}), "max_alternatives"),
    ("regex", "|".join("abcdefghijklmnopqrstu"), "max_alternatives"),  # 21 branches
    ("choice", json.dumps([str(i) for i in range(21)]), "max_alternatives"),
    ("grammar", "\n".join(f'r{i} ::= "{i}"' for i in range(6)), "max_grammar_rules"),
    ("grammar", 'root ::= "a"' + ' | "b"' * 20, "max_alternatives"),  # 21
])
def test_a_constraint_over_a_limit_is_refused_naming_it(kind, spec, limit):
    with pytest.raises(ConstraintLimitError) as info:
        check_limits(kind, spec, SMALL)
    message = str(info.value)
    assert f"--structured-outputs-config.{limit}" in message
    assert str(getattr(SMALL, limit)) in message


@pytest.mark.parametrize("kind,spec", [
    ("json", json.dumps(nested(7))),  # 8 deep
    ("json", json.dumps({"enum": list(range(20))})),
    ("json", "{not json"),  # what is wrong with it is the sandbox's parse to say
    ("regex", "|".join("abcdefghijklmnopqrst")),  # 20 branches
    ("choice", json.dumps(["yes", "no"])),
    ("grammar", 'root ::= "a" | "b"'),
])
def test_a_constraint_within_the_limits_passes(kind, spec):
    check_limits(kind, spec, SMALL)


def test_validate_prompt_applies_the_engines_limits():
    info = EngineInfo(max_model_len=64, vocab_size=100, kv_capacity_tokens=640,
                      eos_token_ids=[1], attention_backend="torch", structured_outputs=SMALL)
    deep = StructuredOutputs(json=json.dumps(nested(8)))
    with pytest.raises(ValueError, match="max_json_depth"):
        validate_prompt([5], SamplingParams(max_tokens=4, structured_outputs=deep), info)
    validate_prompt([5], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(
        json=json.dumps(nested(8)))), EngineInfo(64, 100, 640, [1], "torch"))  # the defaults


def test_the_config_refuses_unknown_fields_and_values_out_of_range():
    assert StructuredOutputsConfig.from_dict({"max_bytes": "1024"}).max_bytes == 1024
    with pytest.raises(ValueError, match="max_byte"):
        StructuredOutputsConfig.from_dict({"max_byte": 10})
    with pytest.raises(ValueError, match="compile_timeout_s"):
        StructuredOutputsConfig(compile_timeout_s=0)
    with pytest.raises(ValueError, match="xgrammar"):
        StructuredOutputsConfig(backend="outlines")
    assert EngineArgs(structured_outputs_config={"cache_mb": 0}).structured_outputs_config == \
        StructuredOutputsConfig(cache_mb=0)


def test_the_command_line_takes_vllms_json_flag_and_dotted_fields():
    args = build_parser().parse_args([
        "serve", "--structured-outputs-config", '{"max_bytes": 100, "cache_mb": 8}',
        "--structured-outputs-config.cache_mb", "16",
        "--structured-outputs-config.compile_timeout_s", "2.5"])
    config = engine_args_from(args).structured_outputs_config
    assert (config.max_bytes, config.cache_mb, config.compile_timeout_s) == (100, 16, 2.5)
    bad = build_parser().parse_args(["serve", "--structured-outputs-config.max_bytes", "many"])
    with pytest.raises(ValueError, match="max_bytes"):
        engine_args_from(bad)
