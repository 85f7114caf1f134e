"""Pydantic models of the OpenAI-compatible requests and responses (unknown request fields are
accepted, as vLLM does)."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mlaserve.engine.request import SamplingParams

NonNegInt = Annotated[int, Field(ge=0)]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


def invalid_text_path(value: Any) -> str | None:
    """The path (e.g. `messages[0].content`) of the first string in a parsed JSON body that is
    not valid Unicode text (a lone surrogate such as "\\ud800"), or None."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and invalid_text_path(key) is not None:
                    return path or "body"
                if isinstance(child, (str, dict, list)):
                    stack.append((child, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            for i, child in enumerate(item):
                if isinstance(child, (str, dict, list)):
                    stack.append((child, f"{path}[{i}]"))
    return None


def token_id_keys(name: str, mapping: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys (strings) that name token ids -> int keys; ValueError naming `name`."""
    if mapping is None:
        return None
    try:
        return {int(key): value for key, value in mapping.items()}
    except ValueError:
        bad = next(key for key in mapping if not key.strip().lstrip("-").isdigit())
        raise ValueError(f"{name} keys must be token ids (integers as strings), got {bad[:20]!r}"
                         ) from None


class RequestModel(OpenAIModel):
    """A request body: every string in it, known field or not, must be valid Unicode text."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        path = invalid_text_path(data)
        if path is not None:
            raise PydanticCustomError(
                "invalid_text", "{param}: the text is not valid Unicode (it holds a lone "
                "surrogate code point)", {"param": path})
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestModel):
    """The sampling fields shared by completions and chat."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: NonNegInt = 0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None, output_kind: str) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=self.min_p or 0.0, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
            logit_bias=token_id_keys("logit_bias", self.logit_bias),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, output_kind=output_kind)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: NonNegInt | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    add_special_tokens: bool = True
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        return prompt


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: str | None = Field(
        None, description="A Jinja chat template to use instead of the model's; refused "
        "unless the server runs with --trust-request-chat-template")
    chat_template_kwargs: dict[str, Any] | None = None

    def request_chat_template(self) -> str | None:
        """The chat template that the request supplies (`chat_template`, or
        `chat_template_kwargs.chat_template`), if any."""
        if self.chat_template is not None:
            return self.chat_template
        template = (self.chat_template_kwargs or {}).get("chat_template")
        return template if template is not None else None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    request_chat_template = ChatCompletionRequest.request_chat_template


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[NonNegInt]


# ---- responses ------------------------------------------------------------------------------
class ResponseModel(BaseModel):
    """A response body (fields beyond OpenAI's are vLLM's)."""


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(ResponseModel):
    """The body of every error answer: `{"error": {message, type, param, code}}`."""

    error: ErrorInfo


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogProbs(ResponseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionResponseChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


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
    reasoning: str | None = None


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


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlaserve"
    root: str | None = Field(None, description="the model directory as given to `serve` "
                             "(benchmark clients load the tokenizer from it)")
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str


class TokenizerInfoResponse(ResponseModel):
    """The tokenizer's settings (its init kwargs that are plain values) for remote clients."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    model_max_length: int
