"""The streamed chunks of /v1/completions and /v1/chat/completions, and the per-token events
of /v1/responses.

msgspec structs rather than the pydantic models of the whole responses (protocol*.py): a
stream sends one chunk per token, and `formatting.sse` encodes a struct several times faster
than pydantic serialises a model. The fields and their order are OpenAI's (and vLLM's): every
choice field is always sent, null where unset; a chunk carries `usage` only where asked for
(`stream_options.include_usage`: the last chunk, with no choices; with
`continuous_usage_stats` every chunk).
"""

from typing import Any

import msgspec


class CompletionStreamChoice(msgspec.Struct):
    """One prompt-sample's new text; logprobs as `formatting.completion_logprobs` makes them."""

    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatStreamChoice(msgspec.Struct):
    """One sample's delta message (role, content, reasoning, tool_calls as they settle)."""

    index: int
    delta: dict[str, Any]
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class StreamChunk(msgspec.Struct, omit_defaults=True):
    """`text_completion` or `chat.completion.chunk`; usage ({prompt, completion, total}_tokens)
    left out unless set."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionStreamChoice] | list[ChatStreamChoice]
    usage: dict[str, int] | None = None


class ResponseTextDelta(msgspec.Struct, omit_defaults=True):
    """`response.output_text.delta` (with `logprobs`, always []) or
    `response.reasoning_text.delta` (without): the event a streamed response sends per token.
    Its other events are the pydantic models of `protocol_responses.ResponseStreamEvent`."""

    type: str
    sequence_number: int
    output_index: int
    content_index: int
    item_id: str
    delta: str
    logprobs: list[Any] | None = None


def chunk_head(response_id: str, kind: str, created: int, model: str) -> StreamChunk:
    """A stream's chunk with no choices: the others are copies of it (`msgspec.structs.replace`)."""
    return StreamChunk(id=response_id, object=kind, created=created, model=model, choices=[])


__all__ = ["ChatStreamChoice", "CompletionStreamChoice", "ResponseTextDelta", "StreamChunk",
           "chunk_head"]
