"""The /v1/chat/completions request and response models: messages, tools and tool choice, chat
logprobs and the assistant message."""

from typing import Any, ClassVar, Literal

from pydantic import Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from mlaserve.server.protocol import (
    NonNegInt,
    OpenAIModel,
    PromptLogprobs,
    ResponseModel,
    SamplingFields,
    UsageInfo,
    equal_to,
)
from mlaserve.server.tool_call_models import ToolCall


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    """A message; OpenAI's `refusal`, `annotations`, `audio` and `function_call` (what the SDK
    echoes back from a response) are accepted when empty and refused otherwise."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="an assistant message's tool calls (passed to the chat template)")
    tool_call_id: str | None = Field(None, description="a tool message's call id")
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="the same as reasoning_content")
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _echoed_fields_empty(self) -> "ChatMessage":
        for name in ("refusal", "annotations", "audio", "function_call"):
            if getattr(self, name):
                raise PydanticCustomError("unsupported", "{param}: {why}", {
                    "param": f"messages.{name}",
                    "why": f"a message's {name} is not supported (only its empty value)"})
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.content is None and self.tool_calls:
            message["content"] = None
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            value = getattr(self, key)
            if value is not None:
                message[key] = value
        if self.reasoning_content is None and self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    """A `tool_choice` that forces one function."""

    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    unsupported: ClassVar = (
        ("echo", equal_to(False), "echo is not supported on chat"),
        ("best_of", equal_to(1), "best_of is served on /v1/completions (chat answers with n "
                                 "samples)"))

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: \"auto\" with tools, else \"none\"")
    parallel_tool_calls: bool = Field(
        True, description="false: at most one tool call per answer")
    include_reasoning: bool = Field(True, description="vLLM's: false drops the reasoning")
    continue_final_message: bool = Field(
        False, description="vLLM's: continue the last (assistant) message instead of "
        "starting a new one")
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    add_special_tokens: bool = Field(
        False, description="add the tokenizer's special tokens (BOS) to the rendered template")
    chat_template: str | None = Field(
        None, description="A Jinja chat template to use instead of the model's; refused "
        "unless the server runs with --trust-request-chat-template")
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("unsupported", "{param}: {why}", {
                "param": "top_logprobs", "why": "top_logprobs needs logprobs set to true"})
        return self

    def request_chat_template(self) -> str | None:
        """The chat template that the request supplies (`chat_template`, or
        `chat_template_kwargs.chat_template`), if any."""
        if self.chat_template is not None:
            return self.chat_template
        template = (self.chat_template_kwargs or {}).get("chat_template")
        return template if template is not None else None

    def effective_tool_choice(self) -> str | dict[str, Any]:
        """`tool_choice` as given, or OpenAI's default: "auto" with tools, else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice


class ChatTopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogProbs(ResponseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = Field(None, description="the reasoning (with --reasoning-parser)")
    reasoning_content: str | None = Field(None, description="the same reasoning, under the "
                                          "name DeepSeek's API uses")
    tool_calls: list[ToolCall] | None = Field(None, description="omitted when there are none")

    @model_serializer(mode="wrap")
    def _omit_no_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatCompletionResponseChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
