"""The tool-call models shared by the parsers, the chat protocol and the chat output: a call
of a response message, the pieces of a streamed call, and fresh call ids."""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, Field


def make_tool_call_id() -> str:
    """A fresh tool-call id, `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(BaseModel):
    """A tool call of a chat response message."""

    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call (serialize with `model_dump(exclude_none=True)`)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ToolStreamDelta(BaseModel):
    """What one text delta adds: content and tool-call pieces."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    def is_empty(self) -> bool:
        return self.content is None and not self.tool_calls
