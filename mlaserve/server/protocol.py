"""Pydantic models of the OpenAI-compatible requests and responses (unknown request fields are
accepted, as vLLM does)."""

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mlaserve.engine.request import SamplingParams, StructuredOutputs
from mlaserve.server.tool_calls import ToolCall

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


# ---- structured outputs ---------------------------------------------------------------------
class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: the schema the output follows (enforced also when
    `strict` is false)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(max_length=256)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(OpenAIModel):
    """vLLM's `structured_outputs` field: exactly one constraint."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json",
                                               description="a JSON schema (object or text)")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = Field(
        False, description="JSON without whitespace between tokens; alone (no constraint "
        "here) it applies to the constraint that response_format or guided_json sets")


def _is(default: Any) -> Callable[[Any], bool]:
    return lambda value: value == default


def _empty(value: Any) -> bool:
    return not value


def _never(value: Any) -> bool:
    return False


# OpenAI and vLLM request fields this server does not honour: (name, accepted when, why). Each
# is refused with a 400 when set to anything else, so that nothing is silently ignored.
UNSUPPORTED_FIELDS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("use_beam_search", _is(False), "beam search is not supported"),
    ("length_penalty", _is(1.0), "length_penalty applies to beam search, which is not "
                                 "supported"),
    ("guided_decoding_backend", lambda v: v in ("auto", "xgrammar"),
     "the only structured output backend is xgrammar"),
    ("guided_whitespace_pattern", _never, "a custom whitespace pattern is not supported"),
    ("allowed_token_ids", _never, "allowed_token_ids is not supported (use logit_bias)"),
    ("bad_words", _empty, "bad_words is not supported"),
    ("prompt_embeds", _never, "prompt embeddings are not supported"),
    ("priority", _is(0), "request priorities are not supported"),
    ("spaces_between_special_tokens", _is(True),
     "spaces_between_special_tokens false is not supported"),
    ("return_tokens_as_token_ids", _is(False), "return_tokens_as_token_ids is not supported"),
    ("return_token_ids", _is(False), "return_token_ids is not supported"),
    ("detokenize", _is(True), "detokenize false is not supported"),
    ("cache_salt", _never, "cache_salt is not supported"),
    ("kv_transfer_params", _never, "KV transfer is not supported"),
    ("vllm_xargs", _never, "vllm_xargs is not supported"),
    ("logits_processors", _never, "custom logits processors are not supported"),
    ("mm_processor_kwargs", _never, "this model takes text only"),
    ("store", _is(False), "responses are not stored by this server"),
    ("metadata", _empty, "metadata applies to stored responses, which this server does not "
                         "keep"),
    ("service_tier", lambda v: v in ("auto", "default"), "service tiers are not supported"),
    ("prediction", _never, "predicted outputs are not supported"),
    ("audio", _never, "this model answers in text only"),
    ("modalities", lambda v: v == ["text"], "this model answers in text only"),
    ("web_search_options", _never, "web search is not supported"),
    ("functions", _never, "the legacy `functions` field is not supported; use `tools`"),
    ("function_call", _never, "the legacy `function_call` field is not supported; use "
                              "`tool_choice`"),
    ("reasoning_effort", _never, "reasoning_effort is not supported by this model"),
    ("verbosity", _never, "verbosity is not supported"),
    ("documents", _never, "documents are not supported"),
)


class SamplingFields(RequestModel):
    """The sampling fields shared by completions and chat."""

    # fields of this class's own that are refused unless default (see UNSUPPORTED_FIELDS)
    unsupported: ClassVar[tuple[tuple[str, Callable[[Any], bool], str], ...]] = ()

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

    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="vLLM's: the logprobs of the prompt tokens and of this "
        "many most likely tokens at each prompt position (the first position is null)")
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, description="vLLM's: keep only the last this many prompt tokens")
    request_id: str | None = Field(None, max_length=256,
                                   description="vLLM's: the id of the response")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="vLLM's structured outputs: exactly one constraint")
    guided_json: str | dict[str, Any] | None = Field(
        None, description="vLLM's: a JSON schema the output follows")
    guided_regex: str | None = Field(None, description="vLLM's: a regular expression the "
                                     "output matches")
    guided_choice: list[str] | None = Field(None, description="vLLM's: the output is one of "
                                            "these strings")
    guided_grammar: str | None = Field(None, description="vLLM's: an EBNF grammar the output "
                                       "follows")

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "SamplingFields":
        """A field this server would not honour is refused, never ignored."""
        for name, allowed, why in UNSUPPORTED_FIELDS + self.unsupported:
            value = getattr(self, name, None) if name in type(self).model_fields else (
                (self.model_extra or {}).get(name))
            if value is not None and not allowed(value):
                raise PydanticCustomError(
                    "unsupported", "{param}: {why}", {"param": name, "why": why})
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None, output_kind: str,
                        structured_outputs: StructuredOutputs | None = None,
                        seed_offset: int = 0) -> SamplingParams:
        """The engine's SamplingParams of this request (`seed_offset`: the sample's index
        among n, added to a given seed so that each sample is reproducible alone)."""
        seed = None if self.seed is None else self.seed + seed_offset
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=self.min_p or 0.0, seed=seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
            logit_bias=token_id_keys("logit_bias", self.logit_bias),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, output_kind=output_kind,
            structured_outputs=structured_outputs)


class CompletionRequest(SamplingFields):
    unsupported: ClassVar = (
        ("suffix", _empty, "suffix (fill-in-the-middle) is not supported: the model has no "
                           "fill-in-the-middle template here"),)

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: NonNegInt | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    add_special_tokens: bool = True
    suffix: str | None = Field(None, description="refused unless empty: no fill-in-the-middle "
                               "template is served")
    best_of: int | None = Field(None, ge=1, description="generate this many samples per "
                                "prompt and return the n with the highest log probability")

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
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="an assistant message's tool calls (passed to the chat template)")
    tool_call_id: str | None = Field(None, description="a tool message's call id")
    reasoning_content: str | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.content is None and self.tool_calls:
            message["content"] = None
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            value = getattr(self, key)
            if value is not None:
                message[key] = value
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
    unsupported: ClassVar = (("echo", _is(False), "echo is not supported on chat"),)

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


class PromptLogprob(ResponseModel):
    """vLLM's logprob entry of one token at a prompt position."""

    logprob: float
    rank: int | None = Field(None, description="1 is the most likely token; null where the "
                             "token is not among the top ones asked for")
    decoded_token: str | None = None


# per prompt position (the first is null): token id -> its entry
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


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


# ---- the Responses API ----------------------------------------------------------------------
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
    ("previous_response_id", _never, "responses are not stored, so there is no previous "
                                     "response to continue"),
    ("tools", _empty, "tools are served on /v1/chat/completions only"),
    ("tool_choice", lambda v: v in ("none", "auto"), "tools are served on "
                                                     "/v1/chat/completions only"),
    ("reasoning", _empty, "reasoning options are not supported"),
    ("truncation", _is("disabled"), "truncation \"auto\" is not supported; an input over the "
                                    "context is refused"),
    ("background", _is(False), "background responses are not supported"),
    ("include", _empty, "include is not supported"),
    ("top_logprobs", _is(0), "logprobs are served on /v1/chat/completions"),
    ("conversation", _never, "conversations are not stored"),
    ("prompt", _never, "prompt templates are not supported"),
    ("max_tool_calls", _never, "tools are served on /v1/chat/completions only"),
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
