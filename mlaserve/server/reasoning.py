"""Reasoning parsers: split a reasoning model's output into `reasoning` and `content`.

DeepSeek-R1 (and DeepSeek-V3.1+ in thinking mode) writes its chain of thought between `<think>`
and `</think>` and the answer after it. The R1 chat template usually ends the prompt with
`<think>\\n`, so the output often starts inside the reasoning without any start tag.

The rule of the `deepseek_r1` parser (the one vLLM's `--reasoning-parser deepseek_r1` follows for
outputs that start with `<think>` or hold no `<think>` at all):

* everything before the first `</think>` is reasoning; everything after it is content (later
  `<think>` / `</think>` tags are plain content);
* the first `<think>` that comes before the first `</think>` is removed (text before it, which
  a model does not normally write, stays reasoning; vLLM drops it when not streaming and keeps
  it as reasoning when streaming, so this parser picks the streaming behaviour for both);
* with no `</think>` at all, the whole text is reasoning and content is None (a generation cut
  short by max_tokens while thinking is all reasoning);
* reasoning is a string even when empty (`"</think>answer"` gives `("", "answer")`); content is
  None when empty (`"<think>r</think>"` gives `("r", None)`).

The `deepseek_v3` parser follows vLLM's: DeepSeek-V3 does not reason unless the chat template is
asked to (`chat_template_kwargs` `thinking` or `enable_thinking` true, the V3.1+ switch); then it
behaves as `deepseek_r1`, otherwise every text is content (reasoning None) and the reasoning
counts as ended from the start.

Interface (the server picks a parser per request, since `deepseek_v3` depends on the request's
`chat_template_kwargs`)::

    parser = get_reasoning_parser("deepseek_r1", chat_template_kwargs)  # ValueError if unknown
    reasoning, content = parser.extract(text)                # whole text (non-streaming)
    stream = parser.stream()                                 # one per choice
    for delta_text in deltas:                                # detokenized text deltas
        reasoning_delta, content_delta = stream.feed(delta_text)   # each str | None
    reasoning_delta, content_delta = stream.finish()         # held-back text, at the end
    stream.ended                                             # `</think>` seen

A stream never emits part of a tag: text that may be the start of a tag (e.g. `"</th"`) is held
back until the next delta settles it, and `finish()` releases it (as reasoning: a tag that never
completed is text). The concatenated reasoning deltas equal `extract(text)[0]` (or "" where that
is None) and the concatenated content deltas equal `extract(text)[1] or ""`, however the text is
cut into deltas.

Structured output (guided decoding) applies only to the content, so the sampler has to know when
the reasoning is over. `parser.reasoning_ended(text)` answers on text; the engine works on token
ids, so it needs the ids of the tags: `parser.tag_token_ids(tokenizer.get_vocab())` gives
`(start_id, end_id)` (ValueError if the tokenizer lacks them; None for a parser that has no
reasoning), and `parser.reasoning_ended_ids(token_ids, tag_ids)` tells from the prompt and output
ids so far whether the last tag seen is `</think>` (vLLM's rule: scan back to the last start or
end tag). Pass the prompt ids too: a template that closes the reasoning in the prompt (V3.1 with
thinking off ends the prompt with `</think>`) has ended it before the first output token, while
R1's prompt ending in `<think>` has not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningDelta(NamedTuple):
    """What one text delta adds to the reasoning and to the content (None where nothing)."""

    reasoning: str | None
    content: str | None


class ThinkTokenIds(NamedTuple):
    """The token ids of the reasoning start and end tags."""

    start: int
    end: int


def held_back(text: str, tags: Sequence[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of one of `tags` (text
    that may turn into a tag once more arrives)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def split_reasoning(text: str) -> tuple[str, str | None]:
    """The `deepseek_r1` rule on a whole text: `(reasoning, content)` (see the module docstring).
    """
    end = text.find(THINK_END)
    if end < 0:
        reasoning, content = text, None
    else:
        reasoning, content = text[:end], text[end + len(THINK_END):] or None
    return reasoning.replace(THINK_START, "", 1), content


def reasoning_ended_ids(token_ids: Sequence[int], tag_ids: ThinkTokenIds) -> bool:
    """Whether the last reasoning tag among `token_ids` is the end tag (False if there is none).
    """
    for token_id in reversed(token_ids):
        if token_id == tag_ids.start:
            return False
        if token_id == tag_ids.end:
            return True
    return False


class ReasoningStream(ABC):
    """Splits a stream of text deltas into reasoning and content deltas."""

    @abstractmethod
    def feed(self, delta: str) -> ReasoningDelta:
        """The reasoning and content that `delta` settles."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The text held back at the end of the output (a partial tag is plain text)."""

    @property
    @abstractmethod
    def ended(self) -> bool:
        """Whether the reasoning section is over (later text is content)."""


class ThinkTagStream(ReasoningStream):
    """The streaming form of `split_reasoning`."""

    def __init__(self) -> None:
        self._buffer = ""
        self._start_seen = False
        self._ended = False

    @property
    def ended(self) -> bool:
        return self._ended

    def feed(self, delta: str) -> ReasoningDelta:
        if self._ended:
            return ReasoningDelta(None, delta or None)
        buffer = self._buffer + delta
        reasoning: list[str] = []
        content: str | None = None
        while True:
            end = buffer.find(THINK_END)
            start = -1 if self._start_seen else buffer.find(THINK_START)
            if start >= 0 and (end < 0 or start < end):
                reasoning.append(buffer[:start])
                buffer = buffer[start + len(THINK_START):]
                self._start_seen = True
                continue
            if end >= 0:
                reasoning.append(buffer[:end])
                content = buffer[end + len(THINK_END):] or None
                buffer = ""
                self._ended = True
                break
            tags = (THINK_END,) if self._start_seen else (THINK_END, THINK_START)
            cut = len(buffer) - held_back(buffer, tags)
            reasoning.append(buffer[:cut])
            buffer = buffer[cut:]
            break
        self._buffer = buffer
        return ReasoningDelta("".join(reasoning) or None, content)

    def finish(self) -> ReasoningDelta:
        rest, self._buffer = self._buffer, ""
        return ReasoningDelta(rest or None, None)


class ContentStream(ReasoningStream):
    """A stream with no reasoning: every delta is content."""

    @property
    def ended(self) -> bool:
        return True

    def feed(self, delta: str) -> ReasoningDelta:
        return ReasoningDelta(None, delta or None)

    def finish(self) -> ReasoningDelta:
        return ReasoningDelta(None, None)


class ReasoningParser(ABC):
    """A reasoning parser for one request; make one with `get_reasoning_parser`."""

    name: ClassVar[str]

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @property
    @abstractmethod
    def reasons(self) -> bool:
        """Whether the output holds a reasoning section at all."""

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, str | None]:
        """`(reasoning, content)` of a whole output."""

    @abstractmethod
    def stream(self) -> ReasoningStream:
        """A fresh streaming parser (one per choice)."""

    @abstractmethod
    def reasoning_ended(self, text: str) -> bool:
        """Whether the reasoning is over at the end of `text` (prompt text and output so far)."""

    @abstractmethod
    def tag_token_ids(self, vocab: Mapping[str, int]) -> ThinkTokenIds | None:
        """The ids of the tags in a tokenizer's vocabulary, or None if the parser has no tags."""

    @abstractmethod
    def reasoning_ended_ids(self, token_ids: Sequence[int],
                            tag_ids: ThinkTokenIds | None) -> bool:
        """`reasoning_ended` on token ids (`tag_ids` from `tag_token_ids`)."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """`<think>` ... `</think>` then the answer; the start tag may be in the prompt instead."""

    name = "deepseek_r1"

    @property
    def reasons(self) -> bool:
        return True

    def extract(self, text: str) -> tuple[str | None, str | None]:
        return split_reasoning(text)

    def stream(self) -> ReasoningStream:
        return ThinkTagStream()

    def reasoning_ended(self, text: str) -> bool:
        return text.rfind(THINK_END) > text.rfind(THINK_START)

    def tag_token_ids(self, vocab: Mapping[str, int]) -> ThinkTokenIds:
        missing = [tag for tag in (THINK_START, THINK_END) if tag not in vocab]
        if missing:
            raise ValueError(f"the {self.name} reasoning parser needs the tokens "
                             f"{', '.join(missing)} in the tokenizer's vocabulary")
        return ThinkTokenIds(vocab[THINK_START], vocab[THINK_END])

    def reasoning_ended_ids(self, token_ids: Sequence[int],
                            tag_ids: ThinkTokenIds | None) -> bool:
        if tag_ids is None:
            raise ValueError(f"the {self.name} reasoning parser needs the tag token ids")
        return reasoning_ended_ids(token_ids, tag_ids)


class NoReasoningParser(ReasoningParser):
    """Every output is content; the reasoning counts as ended from the start."""

    name = "none"

    @property
    def reasons(self) -> bool:
        return False

    def extract(self, text: str) -> tuple[str | None, str | None]:
        return None, text or None

    def stream(self) -> ReasoningStream:
        return ContentStream()

    def reasoning_ended(self, text: str) -> bool:
        return True

    def tag_token_ids(self, vocab: Mapping[str, int]) -> ThinkTokenIds | None:
        return None

    def reasoning_ended_ids(self, token_ids: Sequence[int],
                            tag_ids: ThinkTokenIds | None) -> bool:
        return True


def thinking_requested(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a request's `chat_template_kwargs` turn DeepSeek's thinking mode on."""
    kwargs = chat_template_kwargs or {}
    return bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))


def deepseek_v3_parser(chat_template_kwargs: Mapping[str, Any] | None = None) -> ReasoningParser:
    """`deepseek_v3`: `deepseek_r1` when the request turns thinking on, else no reasoning."""
    if thinking_requested(chat_template_kwargs):
        return DeepSeekR1ReasoningParser(chat_template_kwargs)
    return NoReasoningParser(chat_template_kwargs)


ReasoningParserFactory = Callable[[Mapping[str, Any] | None], ReasoningParser]

REASONING_PARSERS: dict[str, ReasoningParserFactory] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "deepseek_v3": deepseek_v3_parser,
}


def get_reasoning_parser(name: str,
                         chat_template_kwargs: Mapping[str, Any] | None = None
                         ) -> ReasoningParser:
    """The parser registered as `name` for a request with these `chat_template_kwargs`."""
    try:
        factory = REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; the known ones are: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
    return factory(chat_template_kwargs)
