"""Tool calls and reasoning through the HTTP routes with the openai SDK.

Parsing (auto tool choice, reasoning) is checked on a scripted engine that answers with crafted
DeepSeek text cut into awkward deltas, through the real app (ASGI, no engine process); forced
tool choice ("required", a named function) runs on the real server, where the JSON schema
constraint makes the calls valid by construction (the `test_constrained_*` tests)."""

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
import requests

from mlaserve.engine.args import EngineArgs
from mlaserve.engine.request import RequestOutput
from mlaserve.server.api import create_app
from mlaserve.server.serving import Serving
from mlaserve.server.serving_base import ServingOptions
from mlaserve.server.serving_chat import ChatServing
from mlaserve.server.serving_responses import ResponsesServing
from mlaserve.server.state import ServerOptions
from mlaserve.server.tool_calls import CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN, CALLS_END
from tests.server_util import RunningServer

openai = pytest.importorskip("openai")  # test-only; absent on a bare GPU machine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
TIGHT = {"structured_outputs": {"disable_any_whitespace": True}}

V3_CALLS = (f"Let me check.{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}get_weather\n```json\n"
            f'{{"city": "Paris", "unit": "c"}}\n```{CALL_END}{CALL_BEGIN}function{CALL_SEP}'
            f'get_time\n```json\n{{"zone": "utc"}}\n```{CALL_END}{CALLS_END}')
THINKING = "<think>The user wants\nthe weather.</think>It is sunny."


def cut(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


class ScriptedEngine:
    """Answers every request with `pieces` (one delta output each; the final output joins
    them), on the demo tokenizer; records the SamplingParams it was given."""

    def __init__(self, pieces: list[str]) -> None:
        self.tokenizer = _demo_tokenizer()
        self.info = SimpleNamespace(max_model_len=2048, vocab_size=len(self.tokenizer))
        self.pieces = pieces
        self.params = []

    async def add_request(self, ids, params, request_id):
        self.params.append(params)
        pieces = self.pieces

        async def outputs():
            if params.output_kind == "delta":
                for i, piece in enumerate(pieces):
                    await asyncio.sleep(0)
                    last = i == len(pieces) - 1
                    yield RequestOutput(request_id, None, ids, piece, [1],
                                        "stop" if last else None, output_kind="delta")
            else:
                yield RequestOutput(request_id, None, ids, "".join(pieces), [1] * len(pieces),
                                    "stop", output_kind="final_only")
        return outputs()

    def abort(self, request_id):
        pass


def _demo_tokenizer():
    from transformers import AutoTokenizer

    from mlaserve.engine.args import DEMO_MODEL_DIR
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


class ThinkVocab:
    """The demo tokenizer with `<think>` / `</think>` ids in its vocabulary (as R1's has)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def get_vocab(self):
        return {**self._tokenizer.get_vocab(), "<think>": 1000, "</think>": 1001}


def scripted_client(pieces: list[str], think_vocab: bool = False, **options):
    """An AsyncOpenAI client on the app with a scripted engine, and that engine."""
    options = {"enable_auto_tool_choice": True, "tool_call_parser": "deepseek_v3", **options}
    app = create_app(EngineArgs(device="cpu"), "demo", None, ServerOptions(**options))
    engine = ScriptedEngine(pieces)
    state = app.state.server
    serving = Serving(engine, ("demo",), "demo", ServingOptions(**options))
    if think_vocab:
        serving.tokenizer = ThinkVocab(serving.tokenizer)
    state.serving, state.chat = serving, ChatServing(serving)
    state.responses = ResponsesServing(state.chat)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http), engine


async def whole_and_streamed(client, **kwargs):
    kwargs = {"model": "demo", "messages": [{"role": "user", "content": "weather?"}],
              **kwargs}
    whole = await client.chat.completions.create(**kwargs)
    chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
    return whole, chunks


def assemble(chunks):
    """What a client builds from a stream: content, reasoning, tool calls, finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


# ---- auto tool choice (parsed) ---------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_auto_tool_calls_whole_and_streamed(size):
    async def run():
        client, _ = scripted_client(cut(V3_CALLS, size))
        return await whole_and_streamed(client, tools=[WEATHER, TIME])

    whole, chunks = asyncio.run(run())
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "utc"})]
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function"
               for c in message.tool_calls)
    content, _, calls, finish = assemble(chunks)
    assert finish == "tool_calls" and content == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    assert all(c["id"] for c in calls)


def test_parallel_tool_calls_false_keeps_the_first_call():
    async def run():
        client, _ = scripted_client(cut(V3_CALLS, 5))
        return await whole_and_streamed(client, tools=[WEATHER, TIME],
                                        parallel_tool_calls=False)

    whole, chunks = asyncio.run(run())
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_weather"]
    assert [c["name"] for c in assemble(chunks)[2]] == ["get_weather"]


def test_tool_choice_none_reads_no_calls():
    async def run():
        client, _ = scripted_client(cut(V3_CALLS, 4))
        return await whole_and_streamed(client, tools=[WEATHER], tool_choice="none")

    whole, chunks = asyncio.run(run())
    assert whole.choices[0].message.tool_calls is None
    assert whole.choices[0].message.content == V3_CALLS
    assert whole.choices[0].finish_reason == "stop"
    assert assemble(chunks)[0] == V3_CALLS


def test_plain_text_with_auto_tools_is_content():
    async def run():
        client, _ = scripted_client(cut("No tools needed.", 2))
        return await whole_and_streamed(client, tools=[WEATHER])

    whole, chunks = asyncio.run(run())
    assert whole.choices[0].message.content == "No tools needed."
    assert whole.choices[0].finish_reason == "stop"
    assert assemble(chunks)[:3] == ("No tools needed.", "", [])


def test_auto_without_the_flag_is_vllms_400():
    with RunningServer(max_model_len=128) as server:
        body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
        for extra in ({}, {"tool_choice": "auto"}):
            r = requests.post(server.url + "/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 400
            assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        for bad, says in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "nope"), ({"tool_choice": "required", "tools": []}, "required"),
                          ({"functions": [{"name": "f"}]}, "functions"),
                          ({"function_call": "auto"}, "function_call")):
            r = requests.post(server.url + "/v1/chat/completions", json={**body, **bad})
            assert r.status_code == 400 and says in r.text, r.text


# ---- forced tool choice, scripted ------------------------------------------------------------
REQUIRED_CALLS = ('[{"name":"get_weather","parameters":{"city":"Paris","unit":"c"}},'
                  '{"name": "get_time" , "parameters" : { "zone": "utc" } } ]')


def chunk_kinds(chunks) -> list[str]:
    """Each chunk as vLLM's stream orders them: role, name N, args N, finish."""
    kinds = []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            parts = ["role"] if delta.role else []
            for call in delta.tool_calls or []:
                if call.function.name:
                    parts.append(f"name {call.index}")
                if call.function.arguments:
                    parts.append(f"args {call.index}")
            if delta.content:
                parts.append("content")
            if choice.finish_reason:
                parts.append(f"finish {choice.finish_reason}")
            kinds.append("+".join(parts) or "empty")
    return kinds


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_required_tool_calls_stream_call_by_call(size):
    """Streamed "required" calls: each call's name, then its arguments, then the next call;
    the finish alone in the last chunk, so the SDK's stream helper ends every call."""
    async def run():
        client, _ = scripted_client(cut(REQUIRED_CALLS, size))
        kwargs = {"model": "demo", "messages": [{"role": "user", "content": "weather?"}],
                  "tools": [WEATHER, TIME], "tool_choice": "required"}
        whole = await client.chat.completions.create(**kwargs)
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
        done = []
        async with client.chat.completions.stream(**kwargs) as stream:
            async for event in stream:
                if event.type == "tool_calls.function.arguments.done":
                    done.append((event.index, event.name, event.arguments))
        return whole, chunks, done

    whole, chunks, done = asyncio.run(run())
    calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert calls == [("get_weather", '{"city":"Paris","unit":"c"}'),
                     ("get_time", '{ "zone": "utc" }')]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content is None
    assert done == [(0, "get_weather", calls[0][1]), (1, "get_time", calls[1][1])]
    content, _, streamed, finish = assemble(chunks)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    kinds = [k for k in chunk_kinds(chunks) if k != "empty"]
    assert kinds[0] == "role" and kinds[-1] == "finish tool_calls"
    order = []  # runs of the same kind collapsed
    for kind in kinds[1:-1]:
        for part in kind.split("+"):
            if not order or order[-1] != part:
                order.append(part)
    assert order == ["name 0", "args 0", "name 1", "args 1"]


def test_a_forced_call_cut_short_keeps_its_partial_arguments():
    """max_tokens inside a forced call: the calls begun so far, finish_reason "length", no
    content (as OpenAI answers), whole and streamed alike."""
    text = ('[{"name":"get_weather","parameters":{"city":"Paris"}},'
            '{"name":"get_time","parameters":{"zo')

    class CutEngine(ScriptedEngine):
        async def add_request(self, ids, params, request_id):
            outputs = await super().add_request(ids, params, request_id)

            async def cut_short():
                async for out in outputs:
                    if out.finish_reason is not None:
                        out.finish_reason = "length"
                    yield out
            return cut_short()

    async def run():
        client, engine = scripted_client(cut(text, 3))
        engine.__class__ = CutEngine
        return await whole_and_streamed(client, tools=[WEATHER, TIME], tool_choice="required")

    whole, chunks = asyncio.run(run())
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city":"Paris"}'), ("get_time", '{"zo')]
    content, _, calls, finish = assemble(chunks)
    assert (content, finish) == ("", "length")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", '{"city":"Paris"}'), ("get_time", '{"zo')]


# ---- reasoning -------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_reasoning_is_split_whole_and_streamed(size):
    async def run():
        client, _ = scripted_client(cut(THINKING, size), reasoning_parser="deepseek_r1")
        return await whole_and_streamed(client)

    whole, chunks = asyncio.run(run())
    message = whole.choices[0].message
    extra = message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == "The user wants\nthe weather."
    assert message.content == "It is sunny."
    content, reasoning, _, _ = assemble(chunks)
    assert (reasoning, content) == ("The user wants\nthe weather.", "It is sunny.")
    assert not any("<think" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_include_reasoning_false_drops_it():
    async def run():
        client, _ = scripted_client([THINKING], reasoning_parser="deepseek_r1")
        return await whole_and_streamed(client, extra_body={"include_reasoning": False})

    whole, chunks = asyncio.run(run())
    assert whole.choices[0].message.model_extra["reasoning_content"] is None
    assert assemble(chunks)[:2] == ("It is sunny.", "")


def test_reasoning_then_tool_calls():
    text = "<think>need weather</think>" + V3_CALLS

    async def run():
        client, _ = scripted_client(cut(text, 3), reasoning_parser="deepseek_r1")
        return await whole_and_streamed(client, tools=[WEATHER, TIME])

    whole, chunks = asyncio.run(run())
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == "need weather"
    assert len(message.tool_calls) == 2 and whole.choices[0].finish_reason == "tool_calls"
    content, reasoning, calls, finish = assemble(chunks)
    assert (content, reasoning, len(calls), finish) == ("Let me check.", "need weather", 2,
                                                        "tool_calls")


def test_a_constraint_starts_after_the_reasoning():
    async def run(think_vocab):
        client, engine = scripted_client(['<think>r</think>{"a": 1}'],
                                         reasoning_parser="deepseek_r1", think_vocab=think_vocab)
        try:
            out = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "x"}],
                response_format={"type": "json_object"})
        except openai.BadRequestError as exc:
            return exc, engine
        return out, engine

    out, engine = asyncio.run(run(True))
    assert engine.params[0].structured_outputs.after_token_id == 1001
    assert engine.params[0].structured_outputs.json_object
    assert out.choices[0].message.content == '{"a": 1}'
    error, _ = asyncio.run(run(False))  # the demo vocabulary has no </think> token
    assert isinstance(error, openai.BadRequestError) and "</think>" in str(error)


def test_no_reasoning_split_once_the_prompt_ended_it():
    async def run():
        client, engine = scripted_client(['{"a": 1}'], reasoning_parser="deepseek_r1",
                                         think_vocab=True, trust_request_chat_template=True)
        out = await client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
            extra_body={"chat_template": "{{ messages[0].content }}<think></think>"})
        return out, engine

    out, engine = asyncio.run(run())
    assert engine.params[0].structured_outputs.after_token_id is None
    assert out.choices[0].message.content == '{"a": 1}'
    assert out.choices[0].message.model_extra["reasoning_content"] is None


# ---- forced tool choice on the real server ---------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with RunningServer(options=ServerOptions(trust_request_chat_template=True)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def check_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "unit"}
    assert value["city"] in ("Paris", "Oslo") and value["unit"] in ("c", "f")


def check_call(name: str, arguments: str) -> None:
    if name == "get_weather":
        check_weather(arguments)
    else:
        assert name == "get_time" and json.loads(arguments) in ({"zone": "utc"},
                                                                {"zone": "cet"})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constrained_named_tool_choice_returns_a_valid_call(client, seed):
    kwargs = {"model": "demo", "messages": [{"role": "user", "content": "weather?"}],
              "tools": [WEATHER, TIME], "max_tokens": 60, "seed": seed, "extra_body": TIGHT,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    check_weather(call.function.arguments)
    content, _, calls, finish = assemble(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)]


@pytest.mark.parametrize("parallel", [False, True])
def test_constrained_required_tool_choice_returns_valid_calls(client, parallel):
    kwargs = {"model": "demo", "messages": [{"role": "user", "content": "weather?"}],
              "tools": [WEATHER, TIME], "max_tokens": 120, "seed": 4, "extra_body": TIGHT,
              "tool_choice": "required", "parallel_tool_calls": parallel}
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    if not parallel or choice.finish_reason != "length":
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
        for call in choice.message.tool_calls:
            check_call(call.function.name, call.function.arguments)
        _, _, calls, finish = assemble(client.chat.completions.create(stream=True, **kwargs))
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls]


def test_tools_reach_the_chat_template(server):
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{{ messages[-1].content }}")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template": template, "tool_choice": "none"}
    without = requests.post(server.url + "/v1/chat/completions", json=body).json()
    with_tools = requests.post(server.url + "/v1/chat/completions",
                               json={**body, "tools": [WEATHER, TIME]}).json()
    tokenizer = server.engine.tokenizer
    expected = len(tokenizer("[get_weather][get_time]hi", add_special_tokens=False)["input_ids"])
    assert with_tools["usage"]["prompt_tokens"] == expected
    assert without["usage"]["prompt_tokens"] < expected


def test_tool_messages_reach_the_chat_template(server):
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
                "{% if m.content is none %}(none){% endif %}"
                "{% if m.tool_calls %}<{{ m.tool_calls[0].function.name }}>{% endif %}"
                "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}|{% endfor %}")
    messages = [{"role": "user", "content": "w?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = requests.post(server.url + "/tokenize", json={"messages": messages,
                                                       "chat_template": template})
    ids = r.json()["tokens"]
    assert server.engine.tokenizer.decode(ids) == \
        "user:w?|assistant:(none)<get_weather>|tool:sunny#c1|"
