"""The Responses API (/v1/responses) models: the request (text in, text out), the response
object, its output items and the events of a streamed response."""

from collections.abc import Callable
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mlaserve.server.protocol import (
    UNSUPPORTED_FIELDS,
    NonNegInt,
    OpenAIModel,
    RequestModel,
    ResponseModel,
    StructuredOutputsParams,
    equal_to,
    is_empty,
    never,
)


class InputText(OpenAIModel):
    """A text part; an echoed output part's `annotations` and `logprobs` are accepted."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ResponseInputMessage(OpenAIModel):
    """A message of a Responses `input` list (text only)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = Field(None, description="an echoed output message's id (not used)")
    status: str | None = Field(None, description="an echoed output message's status (not "
                               "used)")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextFormat(OpenAIModel):
    """`text.format` of a Responses request: free text, any JSON object or a JSON schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(
        None, description="OpenAI's; only medium (the model's own length) is served, low and "
        "high are refused")

    @model_validator(mode="after")
    def _medium_only(self) -> "TextConfig":
        if self.verbosity not in (None, "medium"):
            raise PydanticCustomError("unsupported", "{param}: {why}", {
                "param": "text.verbosity", "why": "this model has no verbosity control; only "
                "'medium' is supported"})
        return self


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
    ("enable_response_messages", equal_to(False), "response messages are not returned"),
    ("previous_input_messages", never, "responses are not stored, so there are no previous "
                                       "messages"),
) + tuple(entry for entry in UNSUPPORTED_FIELDS if entry[0] in (
    "store", "metadata", "service_tier", "priority", "cache_salt", "mm_processor_kwargs",
    "logits_processors", "vllm_xargs", "kv_transfer_params"))

# the sampling and structured-output fields a Responses request shares with chat (vLLM's
# ResponsesRequest declares most of them), passed on to the chat request as they are
CHAT_SAMPLING_FIELDS = (
    "seed", "top_k", "min_p", "logit_bias", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "repetition_penalty", "frequency_penalty", "presence_penalty", "structured_outputs",
    "include_stop_str_in_output", "skip_special_tokens", "request_id")


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
    # vLLM's sampling and structured-output fields (CHAT_SAMPLING_FIELDS)
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    repetition_penalty: float | None = Field(None, gt=0)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="vLLM's structured outputs (alone, disable_any_whitespace applies "
        "to text.format)")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    request_id: str | None = Field(None, max_length=256, description="vLLM's: the id of the "
                                   "response")

    @classmethod
    def refused_field_names(cls) -> frozenset[str]:
        return frozenset(name for name, _, _ in RESPONSES_UNSUPPORTED)

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
