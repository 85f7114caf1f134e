"""The Responses API (/v1/responses) models: the request (text in, text out), the response
object, its output items and the events of a streamed response."""

from collections.abc import Callable
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mlaserve.server.protocol import (
    UNSUPPORTED_FIELDS,
    OpenAIModel,
    RequestModel,
    ResponseModel,
    equal_to,
    is_empty,
    never,
)


class InputText(OpenAIModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponseInputMessage(OpenAIModel):
    """A message of a Responses `input` list (text only)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextFormat(OpenAIModel):
    """`text.format` of a Responses request: free text, any JSON object or a JSON schema."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


RESPONSES_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("previous_response_id", never, "responses are not stored, so there is no previous "
                                    "response to continue"),
    ("tools", is_empty, "tools are served on /v1/chat/completions only"),
    ("tool_choice", lambda v: v in ("none", "auto"), "tools are served on "
                                                     "/v1/chat/completions only"),
    ("reasoning", is_empty, "reasoning options are not supported"),
    ("truncation", equal_to("disabled"), "truncation \"auto\" is not supported; an input over the "
                                         "context is refused"),
    ("background", equal_to(False), "background responses are not supported"),
    ("include", is_empty, "include is not supported"),
    ("top_logprobs", equal_to(0), "logprobs are served on /v1/chat/completions"),
    ("conversation", never, "conversations are not stored"),
    ("prompt", never, "prompt templates are not supported"),
    ("max_tool_calls", never, "tools are served on /v1/chat/completions only"),
) + tuple(entry for entry in UNSUPPORTED_FIELDS if entry[0] in ("store", "metadata",
                                                                 "service_tier"))


class ResponsesRequest(RequestModel):
    """POST /v1/responses: text in, text out."""

    model: str | None = None
    input: str | list[ResponseInputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: TextConfig | None = None
    parallel_tool_calls: bool = True
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be empty")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "ResponsesRequest":
        for name, allowed, why in RESPONSES_UNSUPPORTED:
            value = (self.model_extra or {}).get(name)
            if value is not None and not allowed(value):
                raise PydanticCustomError(
                    "unsupported", "{param}: {why}", {"param": name, "why": why})
        return self


class ResponseOutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(ResponseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(ResponseModel):
    """A Responses API response object."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    output: list[ResponseOutputMessage | ResponseReasoningItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None


class ResponseStreamEvent(ResponseModel):
    """One event of a streamed response (`type` names it; the other fields follow it)."""

    type: str
    sequence_number: int
    response: ResponsesResponse | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: ResponseOutputMessage | ResponseReasoningItem | None = None
    part: ResponseOutputText | ReasoningText | None = None
    delta: str | None = None
    text: str | None = None
    logprobs: list[Any] | None = None
