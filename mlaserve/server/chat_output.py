"""How a chat answer's text becomes a message: reasoning, content and tool calls.

The text of one choice goes through two steps. First the reasoning parser (`--reasoning-parser`,
see reasoning.py) splits off the reasoning, unless the prompt already ended it. Then the
content is read for tool calls according to the request's tool choice:

* "none" (or no tools): the content is the answer;
* "auto" (needs `--enable-auto-tool-choice --tool-call-parser NAME`): the tool-call parser (see
  tool_calls.py) takes the calls out of the content;
* "required" or a named function: the output was constrained to the JSON of
  `tool_choice.tool_call_json_schema`, and `tool_choice.ForcedCallReader` reads it into calls as
  it streams (each call's name, then its argument pieces, then the next call); an answer cut
  short by max_tokens keeps the calls begun, the last with partial arguments (finish_reason
  "length"), as OpenAI answers.

`ChatOutputParser.parse` does this on a whole text, `ChatOutputParser.stream()` on the text deltas
of a stream (one stream per choice), giving OpenAI-shaped deltas: the concatenated reasoning and
content deltas equal what `parse` gives, and the tool-call deltas follow the openai SDK's shape.
With `parallel_tool_calls` false only the first call is kept.
"""

from dataclasses import dataclass, field
from typing import Any, Literal

from mlaserve.server.reasoning import ReasoningParser, ReasoningStream
from mlaserve.server.tool_call_models import (
    DeltaToolCall,
    ToolCall,
)
from mlaserve.server.tool_calls import DeepSeekV3ToolParser, DeepSeekV3ToolStream
from mlaserve.server.tool_choice import ForcedCallReader

ToolMode = Literal["none", "auto", "forced"]


@dataclass
class ParsedMessage:
    """A whole answer: reasoning (None without a reasoning section), content, tool calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ChatDelta:
    """What one text delta adds to a choice's message."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def is_empty(self) -> bool:
        return self.reasoning is None and self.content is None and not self.tool_calls

    def message_delta(self, include_reasoning: bool = True) -> dict[str, Any]:
        """The `delta` object of a chat.completion.chunk (reasoning under both of its names)."""
        delta: dict[str, Any] = {}
        if self.reasoning is not None and include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = self.reasoning
        if self.content is not None:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [call.model_dump(exclude_none=True)
                                   for call in self.tool_calls]
        return delta

    def add(self, other: "ChatDelta") -> None:
        if other.reasoning is not None:
            self.reasoning = (self.reasoning or "") + other.reasoning
        if other.content is not None:
            self.content = (self.content or "") + other.content
        self.tool_calls.extend(other.tool_calls)


@dataclass
class ChatOutputParser:
    """The reading of one chat request's answers (see the module docstring)."""

    reasoning_parser: ReasoningParser | None = None
    prompt_ended_reasoning: bool = False
    tool_mode: ToolMode = "none"
    tool_choice: Any = None
    tool_parser: DeepSeekV3ToolParser | None = None
    parallel_tool_calls: bool = True

    @property
    def splits_reasoning(self) -> bool:
        return (self.reasoning_parser is not None and self.reasoning_parser.reasons
                and not self.prompt_ended_reasoning)

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = None, text or None
        if self.splits_reasoning:
            reasoning, content = self.reasoning_parser.extract(text)
        calls: list[ToolCall] = []
        if self.tool_mode == "auto" and self.tool_parser is not None:
            content, calls = self.tool_parser.extract(content or "")
        elif self.tool_mode == "forced" and content is not None:
            reader = ForcedCallReader(self.tool_choice)
            reader.feed(content, final=True)
            calls, content = reader.calls, None
        if not self.parallel_tool_calls:
            calls = calls[:1]
        return ParsedMessage(reasoning, content, calls)

    def stream(self) -> "ChatOutputStream":
        return ChatOutputStream(self)


class ChatOutputStream:
    """`ChatOutputParser.parse` over text deltas (one per choice)."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self.reasoning: ReasoningStream | None = (
            parser.reasoning_parser.stream() if parser.splits_reasoning else None)
        self.tools: DeepSeekV3ToolStream | None = (
            parser.tool_parser.stream() if parser.tool_mode == "auto"
            and parser.tool_parser is not None else None)
        self.forced: ForcedCallReader | None = (
            ForcedCallReader(parser.tool_choice) if parser.tool_mode == "forced" else None)

    @property
    def tools_called(self) -> bool:
        """Whether the answer is tool calls (finish_reason "tool_calls")."""
        if self.tools is not None:
            return self.tools.tools_called
        return self.forced is not None and self.forced.complete and bool(self.forced.calls)

    def feed(self, text: str) -> ChatDelta:
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
        else:
            reasoning, content = None, text or None
        delta = self._content(content or "", final=False)
        delta.reasoning = reasoning
        return delta

    def finish(self) -> ChatDelta:
        reasoning, content = None, None
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
        delta = ChatDelta(reasoning=reasoning)
        delta.add(self._content(content or "", final=True))
        return delta

    def _content(self, text: str, final: bool) -> ChatDelta:
        if self.tools is not None:
            step = self.tools.finish() if final and not text else self.tools.feed(text)
            delta = ChatDelta(content=step.content, tool_calls=list(step.tool_calls))
            if final and text:
                last = self.tools.finish()
                delta.add(ChatDelta(content=last.content, tool_calls=list(last.tool_calls)))
            if not self.parser.parallel_tool_calls:
                delta.tool_calls = [c for c in delta.tool_calls if c.index == 0]
            return delta
        if self.forced is None:
            return ChatDelta(content=text or None)
        calls = self.forced.feed(text, final)
        if not self.parser.parallel_tool_calls:
            calls = [call for call in calls if call.index == 0]
        return ChatDelta(tool_calls=calls)
