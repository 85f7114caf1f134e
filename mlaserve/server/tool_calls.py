"""Tool-call parsers: turn DeepSeek-V3's tool-call tokens in an output into OpenAI tool calls.

DeepSeek-V3 writes its tool calls after any content, as special tokens spelled with fullwidth
bars (U+FF5C) and lower one-eighth blocks (U+2581)::

    CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {ARGS}
    ```<｜tool▁call▁end｜>...more calls...<｜tool▁calls▁end｜>

DeepSeek-V3.1 drops the type and the code fence: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}
<｜tool▁call▁end｜>`. One parser reads both: a call whose text before `<｜tool▁sep｜>` is
`function` and whose text after it does not start with `{` or `[` is V3 (the name runs to the end
of that line, then an optional ```` ``` ```` fence line); any other call is V3.1 (the text before
the separator, stripped, is the name, the rest the arguments).

The rules of `extract` (the whole text, as for a non-streaming response):

* no `<｜tool▁calls▁begin｜>`: all text is content (None if empty), no tool calls;
* content is the text before `<｜tool▁calls▁begin｜>` as it is, followed by the text after
  `<｜tool▁calls▁end｜>` if that holds anything but whitespace; text between calls is dropped;
* a call's arguments are its text after the header, stripped of surrounding whitespace and of a
  closing ```` ``` ```` fence, and must parse as JSON; they are passed on as written (not
  re-serialized), so the arguments string is exactly what the model wrote;
* if any call is unterminated (no `<｜tool▁call▁end｜>`, e.g. cut by max_tokens), lacks its
  separator or name, or holds arguments that do not parse, or the block holds no call at all,
  the whole output is content and there are no tool calls (vLLM's fallback when its parse fails);
  the block needs no `<｜tool▁calls▁end｜>` (the model may stop at end-of-sentence first).

Each call gets an id `chatcmpl-tool-<32 hex digits>` and type "function".

Interface (the server keeps one parser per tool-call-parser name; a stream per choice)::

    parser = get_tool_call_parser("deepseek_v3")        # ValueError listing the names if unknown
    content, tool_calls = parser.extract(text)          # str | None, list[ToolCall]
    stream = parser.stream()
    for delta_text in deltas:                           # detokenized text (the content part,
        delta = stream.feed(delta_text)                 #  after any reasoning parser)
        delta.content, delta.tool_calls                 # str | None, list[DeltaToolCall]
    delta = stream.finish()                             # held-back text, at the end
    stream.tool_calls, stream.failed                    # the finished calls; whether it fell back

Stream deltas follow the OpenAI SDK's shape (`DeltaToolCall.model_dump(exclude_none=True)`): a
call opens with `{"index": i, "id": ..., "type": "function", "function": {"name": ...}}` once
its name is known, then sends `{"index": i, "function": {"arguments": PIECE}}` pieces whose
concatenation is exactly the call's final arguments string. Text that may be the start of a
special token, or of the closing fence and whitespace after the arguments, is held back until
later text settles it, so no part of a special token ever goes out as content or arguments.
For output that `extract` accepts, the stream's concatenated content and per-index arguments
equal `extract`'s content (or "") and arguments, however the text is cut into deltas; an
invalid block found before any tool-call delta went out (no calls, a first call that fails)
goes out as content in full, as `extract` gives it. A stream cannot take back what it sent: when
a later call turns out malformed, the text from that call's begin token on goes out as content,
`stream.failed` becomes True, and `stream.tool_calls` keeps only the calls that parsed (set
finish_reason "tool_calls" only when they are non-empty and the stream did not fail).

The special tokens must reach the parser: DeepSeek-V3's tokenizer marks them as not special, so
`skip_special_tokens` keeps them; a tokenizer that marks them special needs the detokenizer to
keep them for requests with tools.

The call models are in tool_call_models.py; forced tool choice (`tool_choice` "required" or a
named function) is in tool_choice.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mlaserve.server.reasoning import held_back
from mlaserve.server.tool_call_models import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    ToolStreamDelta,
    make_tool_call_id,
)


# ---- the format -----------------------------------------------------------------------------
def _special(*words: str) -> str:
    return "<\uff5c" + "\u2581".join(words) + "\uff5c>"


CALLS_BEGIN = _special("tool", "calls", "begin")
CALLS_END = _special("tool", "calls", "end")
CALL_BEGIN = _special("tool", "call", "begin")
CALL_END = _special("tool", "call", "end")
CALL_SEP = _special("tool", "sep")
FENCE = "```"
_WAIT = "wait"


def parse_call_header(body: str, complete: bool) -> tuple[str, int] | str | None:
    """Read the header of a call's text `body` (the text after `<｜tool▁call▁begin｜>`, all of
    it up to `<｜tool▁call▁end｜>` if `complete`, else what has arrived so far): `(name, offset
    of the arguments in body)`, None if the header is malformed, or "wait" if more text is needed
    to tell. A decision made on part of a body stands for every longer one."""

    def more() -> str | None:
        return None if complete else _WAIT

    sep = body.find(CALL_SEP)
    if sep < 0:
        return more()
    head = body[:sep].strip()
    after = sep + len(CALL_SEP)
    post = body[after:]
    if head != "function":
        return (head, after) if head else None
    first = post.lstrip()
    if not first:
        return more()
    if first[0] in "{[":
        return head, after  # V3.1 with a function named "function"
    newline = post.find("\n")
    if newline < 0:
        return more()
    name = post[:newline].strip()
    if not name:
        return None
    rest_at = after + newline + 1
    rest = body[rest_at:]
    stripped = rest.lstrip()
    if stripped.startswith(FENCE):
        fence_end = stripped.find("\n")
        if fence_end < 0:
            return more()
        return name, rest_at + len(rest) - len(stripped) + fence_end + 1
    if not complete and FENCE.startswith(stripped):
        return _WAIT
    return name, rest_at


def clean_arguments(raw: str) -> str:
    """A call's arguments text without surrounding whitespace and closing code fence."""
    args = raw.strip()
    if args.endswith(FENCE):
        args = args[: -len(FENCE)].rstrip()
    return args


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def valid_json(text: str) -> bool:
    """Whether `text` is one JSON value (NaN and Infinity, which Python reads, are not JSON)."""
    try:
        json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return False
    return True


def _parse_block(rest: str) -> tuple[list[ToolCall], str] | None:
    """The calls of the text after `<｜tool▁calls▁begin｜>` and the text after the block, or None
    if the block is invalid."""
    calls: list[ToolCall] = []
    while True:
        begin = rest.find(CALL_BEGIN)
        end = rest.find(CALLS_END)
        if end >= 0 and (begin < 0 or end < begin):
            after = rest[end + len(CALLS_END):]
            break
        if begin < 0:
            after = ""
            break
        body_at = begin + len(CALL_BEGIN)
        body_end = rest.find(CALL_END, body_at)
        if body_end < 0:
            return None
        body = rest[body_at:body_end]
        header = parse_call_header(body, complete=True)
        if not isinstance(header, tuple):
            return None
        name, args_at = header
        arguments = clean_arguments(body[args_at:])
        if not valid_json(arguments):
            return None
        calls.append(ToolCall(function=FunctionCall(name=name, arguments=arguments)))
        rest = rest[body_end + len(CALL_END):]
    if not calls:
        return None
    return calls, after


def extract_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """`(content, tool_calls)` of a whole output (see the module docstring for the rules)."""
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return text or None, []
    parsed = _parse_block(text[start + len(CALLS_BEGIN):])
    if parsed is None:
        return text, []
    calls, after = parsed
    content = text[:start] + (after if after.strip() else "")
    return content or None, calls


# ---- streaming ------------------------------------------------------------------------------
_CONTENT, _BLOCK, _HEADER, _ARGS, _AFTER, _PASS = range(6)


def _hold_trailing_fence(text: str) -> int:
    """How many characters at the end of `text` to hold back while arguments stream: a partial
    `<｜tool▁call▁end｜>` and the whitespace and backticks before it, which `clean_arguments`
    may yet strip."""
    cut = len(text) - held_back(text, (CALL_END,))
    while cut > 0 and (text[cut - 1].isspace() or text[cut - 1] == "`"):
        cut -= 1
    return len(text) - cut


class DeepSeekV3ToolStream:
    """Streams the tool calls of one output (see the module docstring)."""

    def __init__(self) -> None:
        self._state = _CONTENT
        self._buffer = ""  # text not yet consumed
        self._raw: list[str] = []  # text consumed since `<｜tool▁calls▁begin｜>`
        self._call_raw_at = 0  # where the current call starts in _raw
        self._sent_tool_delta = False
        self._name = ""
        self._id = ""
        self._args_sent = ""
        self.tool_calls: list[ToolCall] = []
        self.failed = False

    @property
    def tools_called(self) -> bool:
        """Whether the output made tool calls that all parsed."""
        return bool(self.tool_calls) and not self.failed

    def feed(self, delta: str) -> ToolStreamDelta:
        self._buffer += delta
        return self._advance(final=False)

    def finish(self) -> ToolStreamDelta:
        return self._advance(final=True)

    # -- the state machine --
    def _take(self, n: int) -> str:
        piece, self._buffer = self._buffer[:n], self._buffer[n:]
        if self._state in (_BLOCK, _HEADER, _ARGS):
            self._raw.append(piece)
        return piece

    def _advance(self, final: bool) -> ToolStreamDelta:
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        while self._step(final, content, calls):
            pass
        merged: list[DeltaToolCall] = []
        for call in calls:
            last = merged[-1] if merged else None
            if (last is not None and last.index == call.index and last.function.name is None
                    and call.function.name is None):
                last.function.arguments = (last.function.arguments or "") + (
                    call.function.arguments or "")
            else:
                merged.append(call)
        return ToolStreamDelta(content="".join(content) or None, tool_calls=merged)

    def _fail(self, content: list[str]) -> None:
        self.failed = True
        start = self._call_raw_at if self._sent_tool_delta else 0
        content.append("".join(self._raw[start:]) + self._buffer)
        self._raw.clear()
        self._buffer = ""
        self._state = _PASS

    def _step(self, final: bool, content: list[str], calls: list[DeltaToolCall]) -> bool:
        """Consume what the buffer settles in the current state; True to go on."""
        buffer = self._buffer
        if self._state == _PASS:
            if buffer:
                content.append(self._take(len(buffer)))
            return False
        if self._state == _CONTENT:
            start = buffer.find(CALLS_BEGIN)
            if start >= 0:
                content.append(self._take(start))
                self._state = _BLOCK
                self._take(len(CALLS_BEGIN))
                return True
            keep = 0 if final else held_back(buffer, (CALLS_BEGIN,))
            content.append(self._take(len(buffer) - keep))
            return False
        if self._state == _BLOCK:
            begin = buffer.find(CALL_BEGIN)
            end = buffer.find(CALLS_END)
            if end >= 0 and (begin < 0 or end < begin):
                if not self.tool_calls:
                    self._fail(content)
                    return True
                self._take(end + len(CALLS_END))
                self._state = _AFTER
                return True
            if begin >= 0:
                self._take(begin)
                self._call_raw_at = len(self._raw)
                self._take(len(CALL_BEGIN))
                self._state = _HEADER
                return True
            if final:
                if not self.tool_calls:
                    self._fail(content)
                    return True
                self._buffer = ""
                return False
            self._take(len(buffer) - held_back(buffer, (CALL_BEGIN, CALLS_END)))
            return False
        if self._state == _HEADER:
            end = buffer.find(CALL_END)
            body = buffer if end < 0 else buffer[:end]
            header = parse_call_header(body, complete=end >= 0)
            if header == _WAIT and not final:
                return False
            if not isinstance(header, tuple):
                self._fail(content)
                return True
            self._name, args_at = header
            self._id = make_tool_call_id()
            self._args_sent = ""
            calls.append(DeltaToolCall(index=len(self.tool_calls), id=self._id, type="function",
                                       function=DeltaFunctionCall(name=self._name)))
            self._sent_tool_delta = True
            self._take(args_at)
            self._state = _ARGS
            return True
        if self._state == _ARGS:
            if not self._args_sent:
                self._take(len(buffer) - len(buffer.lstrip()))
                buffer = self._buffer
            end = buffer.find(CALL_END)
            if end >= 0:
                arguments = clean_arguments(self._args_sent + buffer[:end])
                if not valid_json(arguments):
                    self._fail(content)
                    return True
                self._send_args(arguments[len(self._args_sent):], calls)
                self.tool_calls.append(ToolCall(
                    id=self._id, function=FunctionCall(name=self._name, arguments=arguments)))
                self._take(end + len(CALL_END))
                self._state = _BLOCK
                return True
            if final:
                self._fail(content)
                return True
            piece = self._take(len(buffer) - _hold_trailing_fence(buffer))
            self._send_args(piece, calls)
            return False
        # _AFTER: text after the block counts only once it holds more than whitespace
        if buffer.strip():
            self._state = _PASS
            return True
        if final:
            self._buffer = ""
        return False

    def _send_args(self, piece: str, calls: list[DeltaToolCall]) -> None:
        if piece:
            self._args_sent += piece
            calls.append(DeltaToolCall(index=len(self.tool_calls),
                                       function=DeltaFunctionCall(arguments=piece)))


class DeepSeekV3ToolParser:
    """`deepseek_v3`: DeepSeek-V3's tool-call format (and V3.1's)."""

    name = "deepseek_v3"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """`(content, tool_calls)` of a whole output."""
        return extract_tool_calls(text)

    def stream(self) -> DeepSeekV3ToolStream:
        """A fresh streaming parser (one per choice)."""
        return DeepSeekV3ToolStream()


TOOL_CALL_PARSERS: dict[str, Callable[[], DeepSeekV3ToolParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,
}


def get_tool_call_parser(name: str) -> DeepSeekV3ToolParser:
    """The tool-call parser registered as `name`."""
    try:
        factory = TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; the known ones are: "
                         f"{', '.join(sorted(TOOL_CALL_PARSERS))}") from None
    return factory()
