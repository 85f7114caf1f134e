"""The DeepSeek-V3 tool-call parser: whole text, streams cut at every point, forced-choice
schemas, registry."""

import json
import random
import re

import pytest

from mlaserve.server.tool_call_models import DeltaToolCall, ToolCall, ToolStreamDelta
from mlaserve.server.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    CALL_SEP,
    CALLS_BEGIN,
    CALLS_END,
    TOOL_CALL_PARSERS,
    DeepSeekV3ToolParser,
    extract_tool_calls,
    get_tool_call_parser,
    parse_call_header,
)
from mlaserve.server.tool_choice import constrained_tool_calls, tool_call_json_schema

ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
PARSER = get_tool_call_parser("deepseek_v3")


def v3_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{CALL_SEP}{name}\n```json\n{args}\n```{CALL_END}"


def v31_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{CALL_SEP}{args}{CALL_END}"


WEATHER = '{"location": "Beijing", "unit": "celsius"}'
TIME = '{"tz": "Asia/Shanghai"}'
CODE = '{"src": "```py\\nprint(1)\\n```", "n": [1, {}]}'
SAY = '{"text": "<｜tool▁call and 思考 `x`"}'
MULTILINE = '{\n  "a": [\n    1\n  ]\n}'

# (text, content, [(name, arguments)])
VALID_CASES = [
    (f"{CALLS_BEGIN}{v3_call('get_weather', WEATHER)}{CALLS_END}", None,
     [("get_weather", WEATHER)]),
    (f"{CALLS_BEGIN}{v3_call('get_weather', WEATHER)}\n{v3_call('get_time', TIME)}{CALLS_END}",
     None, [("get_weather", WEATHER), ("get_time", TIME)]),
    (f"Let me check.\n\n{CALLS_BEGIN}{v3_call('get_weather', WEATHER)}{CALLS_END}",
     "Let me check.\n\n", [("get_weather", WEATHER)]),
    # no closing block token (the model stopped at end-of-sentence)
    (f"{CALLS_BEGIN}{v3_call('get_time', TIME)}", None, [("get_time", TIME)]),
    # text after the block: whitespace is dropped, anything else is content
    (f"{CALLS_BEGIN}{v3_call('get_time', TIME)}{CALLS_END}\n \n", None, [("get_time", TIME)]),
    (f"A{CALLS_BEGIN}{v3_call('get_time', TIME)}{CALLS_END}\nDone.", "A\nDone.",
     [("get_time", TIME)]),
    # V3.1
    (f"{CALLS_BEGIN}{v31_call('get_weather', WEATHER)}{v31_call('get_time', TIME)}{CALLS_END}",
     None, [("get_weather", WEATHER), ("get_time", TIME)]),
    (f"ok {CALLS_BEGIN}{v31_call('function', '{}')}{CALLS_END}", "ok ", [("function", "{}")]),
    (f"{CALLS_BEGIN}{v31_call('f', ' [1, 2] ')}{CALLS_END}", None, [("f", "[1, 2]")]),
    # no fence, extra whitespace, nested JSON with backticks, braces and tokens-like text
    (f"{CALLS_BEGIN}{CALL_BEGIN} function {CALL_SEP} run \n  {{\"a\": 1}}  {CALL_END}",
     None, [("run", '{"a": 1}')]),
    (CALLS_BEGIN + v3_call("code", CODE), None, [("code", CODE)]),
    (CALLS_BEGIN + v3_call("say", SAY), None, [("say", SAY)]),
    # multi-line arguments as the model writes them
    (CALLS_BEGIN + v3_call("f", MULTILINE) + CALLS_END, None, [("f", MULTILINE)]),
    # junk between calls is dropped
    (f"{CALLS_BEGIN} x {v31_call('f', '{}')} y {v31_call('g', '{}')} z {CALLS_END}", None,
     [("f", "{}"), ("g", "{}")]),
    # a fence with no language
    (f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}f\n```\n{{}}\n```{CALL_END}", None,
     [("f", "{}")]),
]

MALFORMED = [
    f"{CALLS_BEGIN}{v3_call('f', '{not json}')}{CALLS_END}",
    CALLS_BEGIN + v3_call("f", "{}") + v3_call("g", '{"a": 1') + CALLS_END,
    CALLS_BEGIN + v3_call("f", "{}") + v3_call("g", '{"a": NaN}'),
    f"{CALLS_BEGIN}{v3_call('f', '')}",
    f"{CALLS_BEGIN}{CALLS_END}",
    f"{CALLS_BEGIN}",
    f"{CALLS_BEGIN} no calls here",
    f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}f\n```json\n{{\"a\": 1}}",  # cut short
    f"{CALLS_BEGIN}{v31_call('f', '{}')}{CALL_BEGIN}g{CALL_SEP}{{\"a\"",  # second cut short
    f"{CALLS_BEGIN}{CALL_BEGIN}no separator{CALL_END}",
    f"{CALLS_BEGIN}{CALL_BEGIN}{CALL_SEP}{{}}{CALL_END}",  # no name
    f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}\n```json\n{{}}\n```{CALL_END}",  # no name
    f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}f{CALL_END}",  # no newline after the name
    "before " + CALLS_BEGIN + v3_call("f", '{"a": 1}  trailing'),
]


def calls_of(calls: list[ToolCall]) -> list[tuple[str, str]]:
    for call in calls:
        assert ID.fullmatch(call.id)
        assert call.type == "function"
    return [(call.function.name, call.function.arguments) for call in calls]


@pytest.mark.parametrize("text,content,calls", VALID_CASES)
def test_whole_text(text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = extract_tool_calls(text)
    assert got_content == content
    assert calls_of(got_calls) == calls
    for call in got_calls:
        json.loads(call.function.arguments)
    assert PARSER.extract(text)[0] == content


def test_no_tool_calls() -> None:
    assert extract_tool_calls("Hello!") == ("Hello!", [])
    assert extract_tool_calls("") == (None, [])
    # call tokens outside a block are plain text
    text = f"{v3_call('f', '{}')}"
    assert extract_tool_calls(text) == (text, [])


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_block_is_content(text: str) -> None:
    assert extract_tool_calls(text) == (text, [])


def test_ids_are_fresh_and_the_model_serializes() -> None:
    text = f"{CALLS_BEGIN}{v3_call('f', '{}')}{v3_call('f', '{}')}"
    _, calls = extract_tool_calls(text)
    assert calls[0].id != calls[1].id
    dumped = calls[0].model_dump()
    assert dumped == {"id": calls[0].id, "type": "function",
                      "function": {"name": "f", "arguments": "{}"}}


def run_stream(pieces: list[str]) -> tuple[str, dict[int, dict], list, object]:
    """Feed `pieces`; the concatenated content, the calls assembled from the deltas the way an
    OpenAI SDK client does, every delta, and the stream."""
    stream = PARSER.stream()
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content = []
    calls: dict[int, dict] = {}
    for delta in deltas:
        assert isinstance(delta, ToolStreamDelta)
        assert delta.content != ""
        content.append(delta.content or "")
        for call in delta.tool_calls:
            assert isinstance(call, DeltaToolCall)
            dumped = call.model_dump(exclude_none=True)
            if call.id is not None:  # a call opens: its id, type and name come first
                assert call.index not in calls
                assert call.index == len(calls)
                assert ID.fullmatch(call.id)
                assert dumped == {"index": call.index, "id": call.id, "type": "function",
                                  "function": {"name": call.function.name}}
                calls[call.index] = {"id": call.id, "name": call.function.name,
                                     "arguments": ""}
            else:
                assert dumped == {"index": call.index,
                                  "function": {"arguments": call.function.arguments}}
                assert call.function.arguments
                calls[call.index]["arguments"] += call.function.arguments
    return "".join(content), calls, deltas, stream


def cuts(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted(points), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def check_stream(text: str, pieces: list[str]) -> None:
    content, calls = extract_tool_calls(text)
    got_content, got_calls, _, stream = run_stream(pieces)
    assert got_content == (content or ""), pieces
    assert [(c["name"], c["arguments"]) for c in got_calls.values()] == calls_of(calls), pieces
    assert calls_of(stream.tool_calls) == calls_of(calls)
    assert [c.id for c in stream.tool_calls] == [c["id"] for c in got_calls.values()]
    assert stream.tools_called == bool(calls)


@pytest.mark.parametrize("text,content,calls", VALID_CASES)
def test_stream_every_split(text: str, content: str | None, calls: list) -> None:
    check_stream(text, list(text))
    check_stream(text, [text])
    for i in range(len(text) + 1):
        check_stream(text, cuts(text, [i]))


@pytest.mark.parametrize("text,content,calls", VALID_CASES)
def test_stream_random_cuts(text: str, content: str | None, calls: list) -> None:
    rng = random.Random(len(text))
    for _ in range(200):
        points = [rng.randint(0, len(text)) for _ in range(rng.randint(1, 12))]
        check_stream(text, cuts(text, points))


def test_stream_random_texts() -> None:
    rng = random.Random(77)
    parts = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, CALL_SEP, "function", "f", "\n",
             "```json\n", "```", " ", "{}", '{"a": 1}', "[", "x", "<", "<\uff5c", "`"]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 14)))
        points = [rng.randint(0, len(text)) for _ in range(rng.randint(0, 8))]
        pieces = cuts(text, points)
        content, calls = extract_tool_calls(text)
        got_content, got_calls, _, stream = run_stream(pieces)
        if not stream.failed:
            assert got_content == (content or ""), (text, pieces)
            assert [(c["name"], c["arguments"]) for c in got_calls.values()] == \
                calls_of(calls), (text, pieces)
        elif not got_calls:  # fell back before any tool delta: all of it is content
            assert (got_content, calls) == (text, []), (text, pieces)
        else:  # fell back after a call opened: the text from the failed call's begin token on
            # goes out as content, after the content before the block
            assert (content, calls) == (text, []), (text, pieces)
            prefix = text[:text.find(CALLS_BEGIN)]
            assert got_content.startswith(prefix)
            rest = got_content[len(prefix):]
            assert rest.startswith(CALL_BEGIN) and text.endswith(rest), (text, pieces)
            done = [(c.function.name, c.function.arguments) for c in stream.tool_calls]
            assert done == [(c["name"], c["arguments"]) for c in got_calls.values()][:len(done)]
            assert len(done) <= len(got_calls)
        assert stream.failed == (CALLS_BEGIN in text and not calls), (text, pieces)


def test_stream_holds_back_partial_tokens() -> None:
    stream = PARSER.stream()
    assert stream.feed("Sure. <\uff5ctool") == ToolStreamDelta(content="Sure. ")
    # "<｜tool" was no token after all: it goes out with the next delta
    assert stream.feed(" here") == ToolStreamDelta(content="<\uff5ctool here")
    half = len(CALLS_BEGIN) // 2
    assert stream.feed(CALLS_BEGIN[:half]).is_empty()
    assert stream.feed(CALLS_BEGIN[half:] + CALL_BEGIN + "function" + CALL_SEP + "get").is_empty()
    # the call opens once its header (name line and fence line) is complete
    assert stream.feed("_weather\n```js").is_empty()
    delta = stream.feed("on\n")
    assert delta.content is None and len(delta.tool_calls) == 1
    opened = delta.tool_calls[0].model_dump(exclude_none=True)
    call_id = opened.pop("id")
    assert ID.fullmatch(call_id)
    assert opened == {"index": 0, "type": "function", "function": {"name": "get_weather"}}
    assert stream.feed('{"location": "Be').tool_calls[0].model_dump(exclude_none=True) == {
        "index": 0, "function": {"arguments": '{"location": "Be'}}
    assert stream.feed('ijing"}\n`').tool_calls[0].function.arguments == 'ijing"}'
    assert stream.feed("``<\uff5ctool").is_empty()
    assert stream.feed(CALL_END[len("<\uff5ctool"):]).is_empty()
    assert stream.feed(CALLS_END).is_empty()
    assert stream.feed("\n").is_empty()
    assert stream.finish().is_empty()
    assert stream.tools_called and not stream.failed
    assert stream.tool_calls == [ToolCall(id=call_id, function={
        "name": "get_weather", "arguments": '{"location": "Beijing"}'})]


def test_stream_content_end_releases_partial_token() -> None:
    stream = PARSER.stream()
    assert stream.feed("a <\uff5ctool\u2581calls") == ToolStreamDelta(content="a ")
    assert stream.finish() == ToolStreamDelta(content="<\uff5ctool\u2581calls")
    assert not stream.tools_called


def test_stream_whole_output_in_one_delta() -> None:
    text = f"Hi {CALLS_BEGIN}{v3_call('f', WEATHER)}{v31_call('g', TIME)}{CALLS_END}"
    stream = PARSER.stream()
    delta = stream.feed(text)
    assert delta.content == "Hi "
    dumped = [call.model_dump(exclude_none=True) for call in delta.tool_calls]
    for item in dumped:
        item.pop("id", None)
    assert dumped == [
        {"index": 0, "type": "function", "function": {"name": "f"}},
        {"index": 0, "function": {"arguments": WEATHER}},
        {"index": 1, "type": "function", "function": {"name": "g"}},
        {"index": 1, "function": {"arguments": TIME}},
    ]
    assert stream.finish().is_empty()


def test_stream_malformed_before_any_tool_delta_is_all_content() -> None:
    text = f"x{CALLS_BEGIN}{CALL_BEGIN}no separator{CALL_END}tail"
    for pieces in (list(text), [text]):
        content, calls, _, stream = run_stream(pieces)
        assert (content, calls) == (text, {})
        assert stream.failed and not stream.tools_called


def test_stream_malformed_after_a_tool_delta() -> None:
    bad = v3_call("g", '{"a": 1')
    text = f"{CALLS_BEGIN}{v3_call('f', '{}')}{bad} after"
    content, calls, _, stream = run_stream(list(text))
    # f went out and parsed; g's name and argument pieces went out before its JSON failed,
    # so g's text from its begin token goes out as content, and so does what follows
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("f", "{}"),
                                                                    ("g", '{"a": 1')]
    assert content == bad + " after"
    assert stream.failed and not stream.tools_called
    assert [(c.function.name, c.function.arguments) for c in stream.tool_calls] == [("f", "{}")]
    assert extract_tool_calls(text) == (text, [])


def test_stream_malformed_header_after_a_valid_call() -> None:
    bad = f"{CALL_BEGIN}no separator{CALL_END}"
    text = f"{CALLS_BEGIN}{v31_call('f', '{}')}{bad}{CALLS_END}"
    content, calls, _, stream = run_stream(list(text))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("f", "{}")]
    assert content == bad + CALLS_END
    assert stream.failed and not stream.tools_called
    assert len(stream.tool_calls) == 1
    assert extract_tool_calls(text) == (text, [])


def test_stream_cut_short_in_the_arguments() -> None:
    text = f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}f\n```json\n{{\"a\": 1"
    content, calls, _, stream = run_stream(list(text))
    assert calls[0]["name"] == "f" and calls[0]["arguments"] == '{"a": 1'
    assert content == f"{CALL_BEGIN}function{CALL_SEP}f\n```json\n{{\"a\": 1"
    assert stream.failed and stream.tool_calls == []


def test_parse_call_header() -> None:
    assert parse_call_header(f"function{CALL_SEP}f\n```json\n{{}}", True) == (
        "f", len(f"function{CALL_SEP}f\n```json\n"))
    assert parse_call_header(f"function{CALL_SEP}f\n{{}}", True) == (
        "f", len(f"function{CALL_SEP}f\n"))
    assert parse_call_header(f"g{CALL_SEP}{{}}", False) == ("g", len(f"g{CALL_SEP}"))
    assert parse_call_header(f"function{CALL_SEP}{{}}", False) == (
        "function", len(f"function{CALL_SEP}"))
    assert parse_call_header("funct", False) == "wait"
    assert parse_call_header(f"function{CALL_SEP}f", False) == "wait"
    assert parse_call_header(f"function{CALL_SEP}f\n``", False) == "wait"
    assert parse_call_header(f"function{CALL_SEP}f\n```json", False) == "wait"
    assert parse_call_header("funct", True) is None
    assert parse_call_header(f"function{CALL_SEP}f", True) is None
    assert parse_call_header(f" {CALL_SEP}{{}}", False) is None


# ---- forced tool choice ---------------------------------------------------------------------
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "weather now",
    "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
                   "required": ["city"], "$defs": {"City": {"type": "string"}}}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}


def test_schema_for_a_named_function() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    schema = tool_call_json_schema([WEATHER_TOOL, TIME_TOOL], choice)
    assert schema == WEATHER_TOOL["function"]["parameters"]
    assert tool_call_json_schema([WEATHER_TOOL, TIME_TOOL], {
        "type": "function", "function": {"name": "get_time"}}) == {
        "type": "object", "properties": {}}
    with pytest.raises(ValueError, match="'nope', which is not in tools"):
        tool_call_json_schema([WEATHER_TOOL], {"type": "function", "function": {"name": "nope"}})


def test_schema_for_required() -> None:
    schema = tool_call_json_schema([WEATHER_TOOL, TIME_TOOL], "required")
    assert schema == {
        "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": {"type": "object",
                                           "properties": {"city": {"$ref": "#/$defs/City"}},
                                           "required": ["city"]}},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]},
        ]},
        "$defs": {"City": {"type": "string"}},
    }
    # the tool definitions are not changed
    assert "$defs" in WEATHER_TOOL["function"]["parameters"]
    assert "$defs" not in tool_call_json_schema([TIME_TOOL], "required")


def test_schema_errors_and_free_choices() -> None:
    assert tool_call_json_schema([WEATHER_TOOL], "auto") is None
    assert tool_call_json_schema([WEATHER_TOOL], "none") is None
    assert tool_call_json_schema(None, None) is None
    with pytest.raises(ValueError, match="at least one tool"):
        tool_call_json_schema([], "required")
    with pytest.raises(ValueError, match="tool_choice must be"):
        tool_call_json_schema([WEATHER_TOOL], "sometimes")
    with pytest.raises(ValueError, match="each tool must be"):
        tool_call_json_schema([{"type": "function"}], "auto")
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"City": {"type": "integer"}}}}}
    with pytest.raises(ValueError, match="'City' differently"):
        tool_call_json_schema([WEATHER_TOOL, other], "required")


def test_constrained_tool_calls() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    (call,) = constrained_tool_calls(' {"city": "Paris"} ', named)
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert ID.fullmatch(call.id)
    calls = constrained_tool_calls(
        '[{"name": "get_weather", "parameters": {"city": "巴黎"}},'
        ' {"name": "get_time", "parameters": {}}]', "required")
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "巴黎"}'), ("get_time", "{}")]
    with pytest.raises(ValueError, match="not JSON"):
        constrained_tool_calls("{", named)
    with pytest.raises(ValueError, match="non-empty array"):
        constrained_tool_calls("[]", "required")
    with pytest.raises(ValueError, match="does not constrain"):
        constrained_tool_calls("{}", "auto")


def test_registry() -> None:
    assert set(TOOL_CALL_PARSERS) == {"deepseek_v3", "deepseek_v31"}
    assert isinstance(get_tool_call_parser("deepseek_v31"), DeepSeekV3ToolParser)
    with pytest.raises(ValueError) as info:
        get_tool_call_parser("hermes")
    assert str(info.value) == ("unknown tool call parser 'hermes'; the known ones are: "
                               "deepseek_v3, deepseek_v31")


def test_token_spelling() -> None:
    assert CALLS_BEGIN == "<｜tool▁calls▁begin｜>"
    assert CALLS_END == "<｜tool▁calls▁end｜>"
    assert CALL_BEGIN == "<｜tool▁call▁begin｜>"
    assert CALL_END == "<｜tool▁call▁end｜>"
    assert CALL_SEP == "<｜tool▁sep｜>"


def test_stream_random_valid_outputs() -> None:
    """Random well-formed outputs (V3 and V3.1 calls, JSON with backticks, newlines, `<｜` and
    parts of the end token inside strings) cut at random points."""
    rng = random.Random(2024)
    chars = ["a", " ", "\n", "`", "```", "<", "<\uff5c", CALL_END[:6], "思", '"', "\\", "{"]

    def text_value() -> str:
        return "".join(rng.choice(chars) for _ in range(rng.randint(0, 6)))

    def value(depth: int = 0) -> object:
        kind = rng.randint(0, 5 if depth < 2 else 3)
        if kind == 0:
            return {text_value(): value(depth + 1) for _ in range(rng.randint(0, 3))}
        if kind == 1:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return text_value() if kind == 2 else rng.choice([1, 2.5, None, True, -3])

    for _ in range(400):
        expected = []
        body = []
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(["get_weather", "f", "function", "a.b"])
            args = json.dumps({"k": value(), "n": value()}, ensure_ascii=rng.random() < 0.5,
                              indent=rng.choice([None, 2]))
            if rng.random() < 0.5 and name != "function":
                body.append(v3_call(name, args))
            else:
                body.append(v31_call(name, rng.choice(["", " ", "\n"]) + args
                                     + rng.choice(["", "\n"])))
            body.append(rng.choice(["", "\n"]))
            expected.append((name, args))
        pre = rng.choice(["", "Sure.", "x<", "hi <\uff5ctool"])
        post = rng.choice(["", CALLS_END, CALLS_END + "\n", CALLS_END + " done"])
        text = pre + CALLS_BEGIN + "".join(body) + post
        content, calls = extract_tool_calls(text)
        assert calls_of(calls) == expected
        assert content == ((pre + (" done" if post.endswith("done") else "")) or None)
        check_stream(text, cuts(text, [rng.randint(0, len(text))
                                       for _ in range(rng.randint(0, 30))]))
