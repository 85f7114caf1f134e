"""Every field of vLLM's completion, chat and responses requests is honoured or refused.

Table-driven, through the real app on a scripted engine that records what reached it (prompt
ids and SamplingParams): for each field, a request that sets it to a non-default value either
reaches the engine changed as the field says (`HONOURED`: a check on the recorded request or
the answer) or is a 400 whose `param` or message names the field (`REFUSED`). The field lists
are vLLM's request models' (plus OpenAI's), and the tables must cover them: a field added to
the API without a row here fails `test_the_tables_cover_every_field`. Unknown keys inside
nested objects are 400s; unknown top-level keys are accepted and logged once per name.
"""

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from mlaserve.engine.request import RequestOutput
from tests.test_server_tools import WEATHER, ScriptedEngine, scripted_client

pytest.importorskip("openai")

COMPLETION_FIELDS = (
    "model prompt best_of echo frequency_penalty logit_bias logprobs max_tokens n "
    "presence_penalty seed stop stream stream_options suffix temperature top_p user "
    "use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids "
    "include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
    "spaces_between_special_tokens truncate_prompt_tokens allowed_token_ids prompt_logprobs "
    "prompt_embeds add_special_tokens response_format structured_outputs guided_json "
    "guided_regex guided_choice guided_grammar structural_tag guided_decoding_backend "
    "guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids "
    "return_token_ids cache_salt kv_transfer_params vllm_xargs bad_words").split()
CHAT_FIELDS = (
    "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens "
    "max_completion_tokens n presence_penalty response_format seed stop stream stream_options "
    "temperature top_p tools tool_choice reasoning_effort include_reasoning parallel_tool_calls "
    "user best_of use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids "
    "include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
    "spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs allowed_token_ids "
    "bad_words echo add_generation_prompt continue_final_message add_special_tokens documents "
    "chat_template chat_template_kwargs mm_processor_kwargs structured_outputs guided_json "
    "guided_regex guided_choice guided_grammar structural_tag guided_decoding_backend "
    "guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids "
    "return_token_ids cache_salt kv_transfer_params vllm_xargs store metadata service_tier "
    "prediction audio modalities web_search_options functions function_call verbosity").split()
RESPONSES_FIELDS = (
    "background include input instructions max_output_tokens max_tool_calls metadata model "
    "parallel_tool_calls previous_response_id prompt reasoning service_tier store stream "
    "temperature text tool_choice tools top_logprobs top_p truncation user request_id "
    "mm_processor_kwargs priority cache_salt enable_response_messages previous_input_messages "
    "seed top_k min_p logit_bias stop stop_token_ids ignore_eos min_tokens repetition_penalty "
    "frequency_penalty presence_penalty structured_outputs include_stop_str_in_output "
    "skip_special_tokens").split()

Check = Callable[[list, dict], bool]  # (recorded [(ids, params)], the answer's JSON) -> ok


def param(name: str, value: Any, index: int = 0) -> Check:
    return lambda calls, body: getattr(calls[index][1], name) == value


def constraint(kind: str) -> Check:
    return lambda calls, body: getattr(calls[0][1].structured_outputs, kind) not in (None,
                                                                                      False)


SAMPLING: dict[str, tuple[Any, Check]] = {
    "temperature": (0.5, param("temperature", 0.5)),
    "top_p": (0.9, param("top_p", 0.9)),
    "top_k": (5, param("top_k", 5)),
    "min_p": (0.1, param("min_p", 0.1)),
    "seed": (3, param("seed", 3)),
    "stop": (["zz"], param("stop", ["zz"])),
    "stop_token_ids": ([7], param("stop_token_ids", [7])),
    "ignore_eos": (True, param("ignore_eos", True)),
    "presence_penalty": (0.5, param("presence_penalty", 0.5)),
    "frequency_penalty": (0.5, param("frequency_penalty", 0.5)),
    "repetition_penalty": (1.2, param("repetition_penalty", 1.2)),
    "min_tokens": (2, param("min_tokens", 2)),
    "logit_bias": ({"3": 1.5}, param("logit_bias", {3: 1.5})),
    "skip_special_tokens": (False, param("skip_special_tokens", False)),
    "include_stop_str_in_output": (True, param("include_stop_str_in_output", True)),
    "structured_outputs": ({"regex": "[a-z]+"}, constraint("regex")),
    "request_id": ("my-id", lambda calls, body: body["id"] == "my-id"),
    # rows that check acceptance only: an opaque id, or a field at its only served value
    "user": ("someone", lambda calls, body: True),  # OpenAI's end-user id: accepted, opaque
    "model": ("demo", lambda calls, body: body["model"] == "demo"),
}
SHARED_OPENAI_COMPAT: dict[str, tuple[Any, Check]] = {
    **SAMPLING,
    "n": (2, lambda calls, body: len(calls) == 2 and len(body["choices"]) == 2),
    "stream": (True, lambda calls, body: calls[0][1].output_kind == "delta"),
    "stream_options": ({"include_usage": True}, lambda calls, body: '"usage":{' in
                       body.get("text", "")),  # sent with stream (below): a usage chunk
    "prompt_logprobs": (1, param("prompt_logprobs", 1)),
    "truncate_prompt_tokens": (2, lambda calls, body: len(calls[0][0]) == 2),
    "response_format": ({"type": "json_object"}, constraint("json_object")),
    "guided_json": ({"type": "object"}, constraint("json")),
    "guided_regex": ("[a-z]+", constraint("regex")),
    "guided_choice": (["a", "b"], constraint("choice")),
    "guided_grammar": ('root ::= "a"', constraint("grammar")),
    "add_special_tokens": (False, None),  # checked against the prompt without it (below)
    # accepted at their only served value
    "guided_decoding_backend": ("xgrammar", lambda calls, body: True),
    "use_beam_search": (False, lambda calls, body: True),
}
COMPLETION_HONOURED = {
    **SHARED_OPENAI_COMPAT,
    "prompt": ("Hello", lambda calls, body: len(calls[0][0]) > 0),
    "max_tokens": (5, param("max_tokens", 5)),
    "logprobs": (2, param("logprobs", 2)),
    "echo": (True, lambda calls, body: body["choices"][0]["text"].startswith("Hello")),
    "best_of": (2, lambda calls, body: len(calls) == 2 and len(body["choices"]) == 1),
}
CHAT_HONOURED = {
    **SHARED_OPENAI_COMPAT,
    "messages": ([{"role": "user", "content": "Hello"}], lambda calls, body: True),
    "add_special_tokens": (True, None),  # chat's default is false: the template adds BOS
    "max_tokens": (5, param("max_tokens", 5)),
    "max_completion_tokens": (5, param("max_tokens", 5)),
    "logprobs": (True, param("logprobs", 0)),
    "top_logprobs": (2, param("logprobs", 2)),  # sent with logprobs (below)
    "tools": ([WEATHER], None),  # rendered by the template: a longer prompt (below)
    "tool_choice": ("required", constraint("json")),
    "parallel_tool_calls": (False, lambda calls, body: '"maxItems": 1' in
                            calls[0][1].structured_outputs.json),  # with required (below)
    "include_reasoning": (False, lambda calls, body: True),  # no reasoning parser: nothing to drop
    "add_generation_prompt": (False, None),
    "continue_final_message": (True, None),
    "chat_template_kwargs": ({"anything": 1}, lambda calls, body: True),  # template variables
    "chat_template": ("{{ messages[0].content }}!", None),
}
RESPONSES_HONOURED = {
    **SAMPLING,
    "input": ("Hello", lambda calls, body: True),
    "instructions": ("Be brief.", None),
    "max_output_tokens": (5, param("max_tokens", 5)),
    "stream": (True, lambda calls, body: calls[0][1].output_kind == "delta"),
    "text": ({"format": {"type": "json_object"}, "verbosity": "medium"},
             constraint("json_object")),
    "parallel_tool_calls": (True, lambda calls, body: body["parallel_tool_calls"] is True),
    "truncation": ("disabled", lambda calls, body: True),
    "tool_choice": ("none", lambda calls, body: True),
    "store": (False, lambda calls, body: True),
    "background": (False, lambda calls, body: True),
    "enable_response_messages": (False, lambda calls, body: True),
}
COMMON_REFUSED = {
    "use_beam_search": True, "length_penalty": 2.0, "allowed_token_ids": [1],
    "bad_words": ["x"], "priority": 1, "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "structural_tag": "x", "logits_processors": ["x"],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "cache_salt": "x",
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
    "spaces_between_special_tokens": False,
}
COMPLETION_REFUSED = {**COMMON_REFUSED, "suffix": "x", "prompt_embeds": "x"}
CHAT_REFUSED = {
    **COMMON_REFUSED, "echo": True, "best_of": 2, "reasoning_effort": "high",
    "documents": [{"a": "b"}], "mm_processor_kwargs": {"a": 1}, "store": True,
    "metadata": {"a": "b"}, "service_tier": "flex", "prediction": {"type": "content"},
    "audio": {"voice": "x"}, "modalities": ["audio"], "web_search_options": {},
    "functions": [{"name": "f"}], "function_call": "auto", "verbosity": "low",
}
RESPONSES_REFUSED = {
    "background": True, "include": ["x"], "max_tool_calls": 2, "metadata": {"a": "b"},
    "previous_response_id": "r", "prompt": {"id": "p"}, "reasoning": {"effort": "high"},
    "service_tier": "flex", "store": True, "tools": [WEATHER], "tool_choice": "required",
    "top_logprobs": 2, "truncation": "auto", "mm_processor_kwargs": {"a": 1}, "priority": 1,
    "cache_salt": "x", "enable_response_messages": True, "previous_input_messages": [{}],
}
ROUTES = {
    "completions": ("/v1/completions", {"prompt": "Hello", "max_tokens": 3},
                    COMPLETION_FIELDS, COMPLETION_HONOURED, COMPLETION_REFUSED),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                      "max_tokens": 3},
             CHAT_FIELDS, CHAT_HONOURED, CHAT_REFUSED),
    "responses": ("/v1/responses", {"input": "Hello", "max_output_tokens": 3},
                  RESPONSES_FIELDS, RESPONSES_HONOURED, RESPONSES_REFUSED),
}
# what a field needs beside it to be honoured
TOOLS_TEMPLATE = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                  "{{ messages[0].content }}")
COMPANIONS = {
    "completions": {"stream_options": {"stream": True}},
    "chat": {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True},
             "parallel_tool_calls": {"tool_choice": "required", "tools": [WEATHER]},
             "tool_choice": {"tools": [WEATHER]},
             "tools": {"tool_choice": "none", "chat_template": TOOLS_TEMPLATE},
             "continue_final_message": {"add_generation_prompt": False, "messages": [
                 {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]}},
    "responses": {},
}
# fields checked by the prompt they make, against the base request's prompt
PROMPT_CHANGING = ("add_special_tokens", "tools", "add_generation_prompt",
                   "continue_final_message", "chat_template", "instructions")


class RecordingEngine(ScriptedEngine):
    """Answers "ab" (its tokens, with logprobs and prompt logprobs when asked) and records
    (prompt ids, SamplingParams) of every request."""

    async def add_request(self, ids, params, request_id):
        self.calls.append((list(ids), params))
        token_ids = self.tokenizer("ab", add_special_tokens=False)["input_ids"]
        k = params.logprobs

        def logprobs(token: int) -> dict[int, float]:
            return {token: -0.5, **{t: -1.0 - t for t in range(k or 0) if t != token}}

        out = RequestOutput(
            request_id, None, ids, "ab", token_ids, "stop",
            logprobs=None if k is None else [logprobs(t) for t in token_ids],
            prompt_logprobs=None if params.prompt_logprobs is None
            else [None] + [{t: -1.0} for t in ids[1:]],
            output_kind="delta" if params.output_kind == "delta" else "final_only")

        async def outputs():
            await asyncio.sleep(0)
            yield out
        return outputs()


def send(path: str, body: dict, **options) -> tuple[httpx.Response, list]:
    async def run():
        client, engine = scripted_client(["ab"], trust_request_chat_template=True, **options)
        engine.__class__ = RecordingEngine
        engine.calls = []
        http = client._client  # the ASGI transport under the SDK client
        return await http.post(path, json=body), engine.calls
    return asyncio.run(run())


def answer(response: httpx.Response) -> dict:
    """The JSON body, or {"text": the event stream} for a stream."""
    if response.headers["content-type"].startswith("text/event-stream"):
        return {"text": response.text}
    return response.json()


def test_the_tables_cover_every_field():
    for route, (_, _, fields, honoured, refused) in ROUTES.items():
        missing = [f for f in fields if f not in honoured and f not in refused]
        assert not missing, f"{route}: no row for {missing}"


@pytest.mark.parametrize("route,field", [(r, f) for r, spec in ROUTES.items()
                                          for f in spec[3]])
def test_a_field_is_honoured(route, field):
    path, base, fields, honoured, _ = ROUTES[route]
    if field not in fields:
        pytest.skip("shared row for a field this route does not have")
    value, check = honoured[field]
    companions = COMPANIONS[route].get(field, {})
    body = {**base, **companions, field: value}
    response, calls = send(path, body)
    assert response.status_code == 200, response.text
    if field in PROMPT_CHANGING:
        _, plain_calls = send(path, {**base, **companions})
        assert calls[0][0] != plain_calls[0][0], f"{field} did not change the prompt"
    else:
        assert check(calls, answer(response)), (field, calls[0][1] if calls else None)


@pytest.mark.parametrize("route,field", [(r, f) for r, spec in ROUTES.items()
                                          for f in spec[4]])
def test_a_field_is_refused_naming_it(route, field):
    path, base, _, _, refused = ROUTES[route]
    response, calls = send(path, {**base, field: refused[field]})
    assert response.status_code == 400, (field, response.text)
    error = response.json()["error"]
    assert field in (error.get("param") or "") + error["message"], error
    assert not calls


@pytest.mark.parametrize("route,body", [
    ("chat", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}),
    ("chat", {"structured_outputs": {"regex": "a", "no_such_key": 1}}),
    ("chat", {"response_format": {"type": "json_object", "strict": True}}),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "extra": 1}}}),
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "other": 1}}),
    ("chat", {"messages": [{"role": "user", "content": "Hello", "colour": "red"}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi",
                                                        "x": 1}]}]}),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]}),
    ("completions", {"structured_outputs": {"json": {}, "structural_tag": "x"}}),
    ("responses", {"text": {"format": {"type": "json_object", "extra": 1}}}),
    ("responses", {"text": {"verbosity": "high"}}),
    ("responses", {"structured_outputs": {"regexp": "a"}}),
    ("responses", {"input": [{"role": "user", "content": "Hi", "colour": "red"}]}),
])
def test_unknown_or_unserved_nested_keys_are_400(route, body):
    path, base, _, _, _ = ROUTES[route]
    response, calls = send(path, {**base, **body})
    assert response.status_code == 400, response.text
    assert not calls


@pytest.mark.parametrize("body,says", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_vllms_400s_on_chat(body, says):
    response, _ = send("/v1/chat/completions", {**ROUTES["chat"][1], **body})
    assert response.status_code == 400 and says in response.json()["error"]["param"]


def test_an_echoed_sdk_message_is_accepted():
    """What the openai SDK gives back as an assistant message (empty refusal, annotations,
    audio, function_call) goes into the next request unchanged."""
    echoed = {"role": "assistant", "content": "Hi", "refusal": None, "annotations": [],
              "audio": None, "function_call": None, "tool_calls": None}
    response, calls = send("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}, echoed,
                     {"role": "user", "content": "Again"}], "max_tokens": 3})
    assert response.status_code == 200 and calls


def test_unknown_top_level_fields_are_logged_once_per_name(caplog):
    base = ROUTES["chat"][1]
    with caplog.at_level(logging.WARNING, logger="mlaserve.server.protocol"):
        for _ in range(2):
            response, calls = send("/v1/chat/completions",
                                   {**base, "frobnicate_level": 3, "also_unknown": 1})
            assert response.status_code == 200 and calls
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1 and "frobnicate_level" in lines[0] and "also_unknown" in lines[0]
    assert "use_beam_search" not in json.dumps(lines)
