"""Structured outputs through the real server (demo model, random weights): every way a request
can set a constraint, answers that hold it by construction, and the refusals.

The tests named `test_constrained_*` check the constraint itself (the engine's grammar-constrained
sampling); the others check the HTTP mapping and the errors."""

import json
import re

import pytest
import requests

jsonschema_rs = pytest.importorskip("jsonschema_rs")  # test-only; absent on a bare GPU machine

COLOR_SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"], "additionalProperties": False,
}
TIGHT = {"structured_outputs": {"disable_any_whitespace": True}}  # JSON ends soon


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


@pytest.fixture(scope="module")
def client(demo_client):
    return demo_client


def assert_color(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"color", "ok"}
    assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)


def chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 60)
    return client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "a color"}], **kwargs)


# ---- the constraint holds (engine-side grammar sampling) -------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constrained_json_schema_answers_validate(client, seed):
    out = chat(client, seed=seed, temperature=1.0, extra_body=TIGHT, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": COLOR_SCHEMA}})
    assert out.choices[0].finish_reason == "stop"
    assert_color(out.choices[0].message.content)


def test_constrained_guided_json_and_structured_outputs_json_on_completions(client):
    for extra in ({"guided_json": COLOR_SCHEMA, **TIGHT},
                  {"structured_outputs": {"json": COLOR_SCHEMA,
                                          "disable_any_whitespace": True}},
                  {"guided_json": json.dumps(COLOR_SCHEMA), **TIGHT}):
        out = client.completions.create(model="demo", prompt="Color:", max_tokens=60, seed=3,
                                        extra_body=extra)
        assert_color(out.choices[0].text)


def test_constrained_choice_regex_and_grammar(client):
    for seed in range(3):
        out = chat(client, seed=seed, extra_body={"guided_choice": ["yes", "no", "maybe"]})
        assert out.choices[0].message.content in ("yes", "no", "maybe")
        out = chat(client, seed=seed, extra_body={"guided_regex": r"[ab]{2,4}-\d"})
        assert re.fullmatch(r"[ab]{2,4}-\d", out.choices[0].message.content)
        out = chat(client, seed=seed, extra_body={"structured_outputs": {
            "grammar": 'root ::= "up" | "down" | "left"'}})
        assert out.choices[0].message.content in ("up", "down", "left")
        out = chat(client, seed=seed, extra_body={"structured_outputs": {"choice": ["x", "y"]}})
        assert out.choices[0].message.content in ("x", "y")


def test_constrained_json_object_starts_an_object(client):
    out = chat(client, seed=0, max_tokens=40, response_format={"type": "json_object"},
               extra_body=TIGHT)
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_constrained_streamed_and_whole_answers_agree(client):
    kwargs = {"temperature": 0, "extra_body": TIGHT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "c", "schema": COLOR_SCHEMA}}}
    whole = chat(client, **kwargs)
    chunks = list(chat(client, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert_color(text)


PERSON_SCHEMA = {  # nested objects, arrays, enums, integer ranges, string patterns
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3},
        "address": {"type": "object", "properties": {
            "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            "city": {"enum": ["Hangzhou", "Beijing", "Paris"]}},
            "required": ["zip", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"], "additionalProperties": False,
}


def test_constrained_50_sampled_answers_validate_against_a_nested_schema(client):
    answers = []
    for seed in range(5):
        out = chat(client, n=10, seed=seed, temperature=1.0, max_tokens=120, extra_body=TIGHT,
                   response_format={"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": PERSON_SCHEMA}})
        answers += [choice.message.content for choice in out.choices]
        assert all(choice.finish_reason == "stop" for choice in out.choices)
    assert len(answers) == 50
    for answer in answers:
        jsonschema_rs.validate(PERSON_SCHEMA, json.loads(answer))
    assert len(set(answers)) > 1  # sampled, not one answer repeated


def test_constrained_n_samples_each_hold(client):
    out = chat(client, n=3, seed=5, extra_body=TIGHT, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": COLOR_SCHEMA}})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice in out.choices:
        assert_color(choice.message.content)


# ---- mapping and refusals --------------------------------------------------------------------
TWO_AT_ONCE = [
    {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
    {"guided_json": {"type": "object"}, "guided_choice": ["a"]},
    {"structured_outputs": {"regex": "a"}, "guided_grammar": 'root ::= "a"'},
    {"structured_outputs": {"regex": "a", "choice": ["a"]}},
]


@pytest.mark.parametrize("extra", TWO_AT_ONCE)
def test_more_than_one_constraint_is_a_400(server, extra):
    for route, body in (("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "x"}]}),
                        ("/v1/completions", {"prompt": "x"})):
        r = requests.post(server.url + route, json={**body, **extra, "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert "one" in r.json()["error"]["message"]


BAD_CONSTRAINTS = [
    ({"guided_regex": "(unclosed"}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "wrong"}}}}, "wrong"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
]


@pytest.mark.parametrize("extra,says", BAD_CONSTRAINTS)
def test_an_invalid_constraint_is_a_400_that_says_what(server, extra, says):
    r = requests.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] + (error["param"] or ""), error
    assert server.engine.num_in_flight == 0


def test_response_format_text_is_no_constraint(client):
    free = chat(client, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    text = chat(client, temperature=0, max_tokens=8, extra_body={"ignore_eos": True},
                response_format={"type": "text"})
    assert text.choices[0].message.content == free.choices[0].message.content
