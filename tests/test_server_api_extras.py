"""n and best_of, prompt_logprobs, min_tokens with stop strings, GET /v1/models/{id}, the
Responses API, and the fields the server refuses rather than ignores; real server, openai SDK."""

import json

import pytest
import requests

from mlaserve.server.protocol_responses import ResponseStreamEvent
from mlaserve.server.protocol_stream import ResponseTextDelta
from mlaserve.server.serving_responses import sse_event


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


@pytest.fixture(scope="module")
def client(demo_client):
    return demo_client


# ---- n and best_of ---------------------------------------------------------------------------
def test_n_seeded_samples_differ_and_each_is_reproducible_alone(client):
    out = client.completions.create(model="demo", prompt="The cache", max_tokens=8, n=4,
                                    seed=11, extra_body={"ignore_eos": True})
    texts = [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len(set(texts)) == 4
    for i, text in enumerate(texts):
        alone = client.completions.create(model="demo", prompt="The cache", max_tokens=8,
                                          seed=11 + i, extra_body={"ignore_eos": True})
        assert alone.choices[0].text == text
    assert out.usage.prompt_tokens == alone.usage.prompt_tokens
    assert out.usage.completion_tokens == 32


def test_n_streamed_equals_whole_on_both_routes(client):
    kwargs = {"model": "demo", "max_tokens": 6, "n": 3, "seed": 2,
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt=["a", "b"], **kwargs)
    assert [c.index for c in whole.choices] == list(range(6))
    chunks = list(client.completions.create(prompt=["a", "b"], stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    texts = [""] * 6
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 36
    # a request with many right answers (made-up JSON values), so the three samples differ
    messages = [{"role": "user", "content": "Make up an example. Reply in JSON."}]
    whole = client.chat.completions.create(messages=messages, **kwargs)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    texts = [""] * 3
    roles = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert roles == {0, 1, 2}
    assert texts == [c.message.content for c in whole.choices]
    assert len(set(texts)) == 3


def test_best_of_returns_the_n_most_likely_samples(client):
    kwargs = {"model": "demo", "prompt": "x", "max_tokens": 5, "seed": 3,
              "extra_body": {"ignore_eos": True}}
    out = client.completions.create(n=2, best_of=4, **kwargs)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].logprobs is None
    assert out.usage.completion_tokens == 20  # all four samples were generated
    every = client.completions.create(n=4, logprobs=0, **kwargs)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in out.choices] == [c.text for c in ranked[:2]]


@pytest.mark.parametrize("body,says", [
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"n": 100000}, "n"),
    ({"suffix": "tail"}, "suffix"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_sample_counts_and_suffix_are_checked(server, body, says):
    r = requests.post(server.url + "/v1/completions", json={"prompt": "x", **body})
    assert r.status_code == 400 and says in r.text, r.text


# ---- prompt_logprobs -------------------------------------------------------------------------
def test_prompt_logprobs_on_completions_and_chat(server, client):
    out = client.completions.create(model="demo", prompt="The cache is", max_tokens=1,
                                    extra_body={"prompt_logprobs": 2})
    ids = server.engine.tokenizer("The cache is")["input_ids"]
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token) in entry and 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
        assert ranks[:2] == [1, 2]
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str)
                   for e in entry.values())
    echo = client.completions.create(model="demo", prompt="The cache is", max_tokens=1,
                                     echo=True, logprobs=0)
    assert [entries[i][str(t)]["logprob"] for i, t in enumerate(ids) if i] == pytest.approx(
        echo.choices[0].logprobs.token_logprobs[1:len(ids)])
    chat = client.chat.completions.create(model="demo", max_tokens=1,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in entries[1:])


# ---- min_tokens and stop strings -------------------------------------------------------------
def test_min_tokens_holds_back_stop_strings(server, client):
    # an arithmetic question: the demo model answers it in ~20 tokens, so no EOS in the first 12
    # (min_tokens masks EOS, which would change a greedy sample that wanted it)
    base = {"model": "demo", "prompt": "Question: What is 12 + 7 - 5?\nAnswer:",
            "temperature": 0, "max_tokens": 12}
    out = client.completions.create(logprobs=0, extra_body={"ignore_eos": True}, **base)
    tokens = out.choices[0].logprobs.tokens
    text = out.choices[0].text
    # a stop string that first appears in the second token's text
    stop = next(t for t in tokens[1:4] if t.strip() and text.find(t) >= len(tokens[0]))
    cut = client.completions.create(stop=[stop], extra_body={"ignore_eos": True}, **base)
    assert cut.choices[0].finish_reason == "stop" and len(cut.choices[0].text) < len(text)
    held = client.completions.create(stop=[stop], extra_body={"ignore_eos": True,
                                                              "min_tokens": 6}, **base)
    assert held.choices[0].text.startswith(text[: text.find(stop) + len(stop)])
    assert held.usage.completion_tokens >= 6


# ---- models ----------------------------------------------------------------------------------
def test_get_one_model(server, client):
    model = client.models.retrieve("demo")
    assert model.id == "demo" and model.object == "model"
    r = requests.get(server.url + "/v1/models/nope")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "The model `nope` does not exist.",
                                 "type": "NotFoundError", "param": "model", "code": 404}


# ---- the Responses API -----------------------------------------------------------------------
def test_responses_whole_and_streamed_agree(server, client):
    kwargs = {"model": "demo", "input": "Tell me", "instructions": "Be brief.",
              "max_output_tokens": 6, "temperature": 0}
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.output[0].type == "message" and whole.output[0].role == "assistant"
    assert whole.usage.output_tokens <= 6
    if whole.usage.output_tokens == 6:
        assert whole.status == "incomplete"
        assert whole.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete"
                          else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    chat = client.chat.completions.create(
        model="demo", max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Tell me"}])
    assert chat.choices[0].message.content == whole.output_text
    assert chat.usage.prompt_tokens == whole.usage.input_tokens


@pytest.mark.parametrize("kind,extra", [("response.output_text.delta", {"logprobs": []}),
                                        ("response.reasoning_text.delta", {})])
@pytest.mark.parametrize("delta", ['a "b" é', "a \ud800"])
def test_a_delta_event_is_the_pydantic_events_bytes(kind, extra, delta):
    """The per-token deltas go out as msgspec structs (`ResponseTextDelta`): the bytes that the
    pydantic `ResponseStreamEvent` of the other events gives; a lone surrogate, which pydantic
    refuses to encode, escaped."""
    fields = {"type": kind, "sequence_number": 5, "output_index": 1, "content_index": 0,
              "item_id": "msg_1", "delta": delta, **extra}
    event = sse_event(ResponseTextDelta(**fields))
    head, _, data = event.partition(b"\ndata: ")
    assert head == f"event: {kind}".encode() and data.endswith(b"}\n\n")
    assert json.loads(data) == fields
    if delta.isprintable():
        assert event == sse_event(ResponseStreamEvent(**fields))


def test_responses_input_messages_and_text_format(client):
    out = client.responses.create(
        model="demo", max_output_tokens=40, temperature=0,
        input=[{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
               {"role": "user", "content": [{"type": "input_text", "text": "pick"}]}],
        text={"format": {"type": "json_schema", "name": "pick", "schema": {
            "type": "object", "properties": {"v": {"enum": ["a", "b"]}}, "required": ["v"],
            "additionalProperties": False}}},
    )
    # random weights may spend the tokens on the whitespace JSON allows; the start is forced
    assert out.output_text.lstrip().startswith("{")
    if out.status == "completed":
        assert json.loads(out.output_text)["v"] in ("a", "b")


@pytest.mark.parametrize("extra,says", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"background": True}, "background"), ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
])
def test_responses_refuses_what_it_does_not_serve(server, extra, says):
    r = requests.post(server.url + "/v1/responses", json={"input": "x", **extra})
    assert r.status_code == 400 and says in r.text, r.text


# ---- refused rather than ignored -------------------------------------------------------------
REFUSED = [
    ("use_beam_search", True), ("length_penalty", 0.5), ("allowed_token_ids", [1]),
    ("bad_words", ["x"]), ("priority", 1), ("spaces_between_special_tokens", False),
    ("return_tokens_as_token_ids", True), ("guided_whitespace_pattern", " "),
    ("logits_processors", ["x"]), ("store", True), ("metadata", {"a": "b"}),
    ("prediction", {"type": "content", "content": "x"}), ("modalities", ["audio"]),
    ("reasoning_effort", "high"), ("service_tier", "flex"), ("cache_salt", "s"),
]


@pytest.mark.parametrize("field,value", REFUSED)
def test_unhonoured_fields_are_refused_by_name(server, field, value):
    for route, body in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "x"}]})):
        r = requests.post(server.url + route, json={**body, field: value, "max_tokens": 2})
        assert r.status_code == 400, (route, r.text)
        assert r.json()["error"]["param"] == field


def test_defaults_of_refused_fields_are_accepted(server):
    body = {"prompt": "x", "max_tokens": 2, "use_beam_search": False, "length_penalty": 1.0,
            "priority": 0, "store": False, "metadata": {}, "service_tier": "auto",
            "modalities": ["text"], "suffix": "", "guided_decoding_backend": "xgrammar",
            "truncate_prompt_tokens": 5, "request_id": "mine-1"}
    r = requests.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "mine-1"
    r = requests.post(server.url + "/v1/completions",
                      json={"prompt": [5] * 40, "max_tokens": 1, "truncate_prompt_tokens": 7})
    assert r.json()["usage"]["prompt_tokens"] == 7


# ---- vLLM's serve flags ----------------------------------------------------------------------
CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def test_load_chat_template_takes_a_file_or_the_template(tmp_path):
    from mlaserve.server.chat_template_sandbox import load_chat_template

    path = tmp_path / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    assert load_chat_template(str(path)) == CHAT_TEMPLATE
    assert load_chat_template(CHAT_TEMPLATE) == CHAT_TEMPLATE
    with pytest.raises(ValueError, match="cannot read the file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}")


def test_chat_template_and_several_served_model_names():
    """`--chat-template`: chat prompts, /tokenize and /tokenizer_info use it.
    `--served-model-name A B`: both are listed and taken; responses name the one asked for."""
    import openai

    from mlaserve.server.state import ServerOptions
    from tests.server_util import RunningServer

    names = ("demo", "deepseek-ai/DeepSeek-V3")
    with RunningServer(options=ServerOptions(chat_template=CHAT_TEMPLATE,
                                             stats_interval_s=None),
                       served_model_name=names) as running:
        tokenizer = running.state.serving.tokenizer
        messages = [{"role": "user", "content": "2 + 3?"}]
        want = tokenizer("<user>2 + 3?<assistant>", add_special_tokens=False)["input_ids"]
        tokens = requests.post(running.url + "/tokenize",
                               json={"model": "demo", "messages": messages}).json()["tokens"]
        assert tokens == want
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused")
        out = client.chat.completions.create(model="demo", messages=messages, max_tokens=1)
        assert out.usage.prompt_tokens == len(want)
        info = requests.get(running.url + "/tokenizer_info").json()
        assert info["chat_template"] == CHAT_TEMPLATE
        assert [m.id for m in client.models.list().data] == list(names)
        assert client.models.retrieve(names[1]).id == names[1]
        out = client.completions.create(model=names[1], prompt="The cache", max_tokens=1)
        assert out.model == names[1]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="The cache", max_tokens=1)
