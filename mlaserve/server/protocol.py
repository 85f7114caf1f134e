"""The shared pieces of the OpenAI-compatible protocol models: the request base (every string must
be valid Unicode), the sampling fields that
completions and chat share, structured-output parameters, the fields refused unless default, and
the response bodies every endpoint uses (errors, usage, prompt logprobs).

The endpoints' own models are in protocol_completions.py, protocol_chat.py, protocol_responses.py
(the Responses API) and protocol_extras.py (tokenizer and server-info endpoints).

Unknown fields: at the top of a request they are accepted and logged at warning level, once per
name (vLLM's behaviour, so that a client sending another server's extras keeps working); inside
a nested object (`structured_outputs`, `response_format`, `stream_options`, a message, a tool
...) an unknown key is a 400 naming it. Known fields this server cannot honour are refused with
a 400 unless left at their default (`UNSUPPORTED_FIELDS`).
"""

import logging
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from mlaserve.engine.request import SamplingParams, StructuredOutputs

NonNegInt = Annotated[int, Field(ge=0)]
logger = logging.getLogger(__name__)


class OpenAIModel(BaseModel):
    """A nested object of a request: an unknown key is refused (a 400 naming it)."""

    model_config = ConfigDict(extra="forbid")


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


_warned_fields: set[str] = set()  # unknown top-level fields already logged


class RequestModel(OpenAIModel):
    """A request body: every string in it, known field or not, must be valid Unicode text;
    unknown top-level fields are accepted and logged once per name."""

    model_config = ConfigDict(extra="allow")

    @classmethod
    def refused_field_names(cls) -> frozenset[str]:
        """Known fields kept among the extras only to be refused unless default (not logged
        as unknown)."""
        return frozenset()

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        path = invalid_text_path(data)
        if path is not None:
            raise PydanticCustomError(
                "invalid_text", "{param}: the text is not valid Unicode (it holds a lone "
                "surrogate code point)", {"param": path})
        return data

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> "RequestModel":
        unknown = set(self.model_extra or ()) - self.refused_field_names() - _warned_fields
        if unknown:
            _warned_fields.update(unknown)
            logger.warning("The following fields were present in the request but ignored: %s "
                           "(logged once per name)", sorted(unknown))
        return self


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = Field(
        None, description="OpenAI's; stream chunks carry no obfuscation field here, so true is "
        "refused")

    @model_validator(mode="after")
    def _no_obfuscation(self) -> "StreamOptions":
        if self.include_obfuscation:
            raise PydanticCustomError(
                "unsupported", "{param}: {why}", {"param": "stream_options.include_obfuscation",
                                                  "why": "stream obfuscation is not supported"})
        return self


# ---- structured outputs ---------------------------------------------------------------------
class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: the schema the output follows (enforced also when
    `strict` is false)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=256)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(OpenAIModel):
    """vLLM's `structured_outputs` field: exactly one constraint. vLLM's options that are not
    served here are refused unless default; any other key is a 400."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json",
                                               description="a JSON schema (object or text)")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(
        None, description="true: compact JSON, without whitespace between tokens; false: "
        "whitespace allowed (runs of at most 16); unset: the server's "
        "--structured-outputs-config setting (compact by default). Alone (no constraint here) "
        "it applies to the constraint that response_format, guided_json or a forced tool "
        "choice sets")
    structural_tag: str | None = Field(None, description="refused: structural tags are not "
                                       "supported")
    whitespace_pattern: str | None = Field(None, description="refused: a custom whitespace "
                                           "pattern is not supported")
    disable_fallback: bool = Field(False, description="vLLM's; there is one backend, so no "
                                   "fallback either way")
    disable_additional_properties: bool = Field(
        False, description="refused when true: additionalProperties is honoured as the schema "
        "says")

    @model_validator(mode="after")
    def _refuse_unserved(self) -> "StructuredOutputsParams":
        for name, why in (("structural_tag", "structural tags are not supported"),
                          ("whitespace_pattern", "a custom whitespace pattern is not "
                                                 "supported (disable_any_whitespace chooses "
                                                 "compact JSON or bounded whitespace)"),
                          ("disable_additional_properties", "not supported: the schema's own "
                                                            "additionalProperties applies")):
            if getattr(self, name) not in (None, False):
                raise PydanticCustomError("unsupported", "{param}: {why}",
                                          {"param": f"structured_outputs.{name}", "why": why})
        return self


def equal_to(default: Any) -> Callable[[Any], bool]:
    return lambda value: value == default


def is_empty(value: Any) -> bool:
    return not value


def never(value: Any) -> bool:
    return False


# OpenAI and vLLM request fields this server does not honour: (name, accepted when, why). Each
# is refused with a 400 when set to anything else, so that nothing is silently ignored.
UNSUPPORTED_FIELDS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("use_beam_search", equal_to(False), "beam search is not supported"),
    ("length_penalty", equal_to(1.0), "length_penalty applies to beam search, which is not "
                                      "supported"),
    ("guided_decoding_backend", lambda v: v in ("auto", "xgrammar"),
     "the only structured output backend is xgrammar"),
    ("guided_whitespace_pattern", never, "a custom whitespace pattern is not supported"),
    ("structural_tag", never, "structural tags are not supported"),
    ("allowed_token_ids", never, "allowed_token_ids is not supported (use logit_bias)"),
    ("bad_words", is_empty, "bad_words is not supported"),
    ("prompt_embeds", never, "prompt embeddings are not supported"),
    ("priority", equal_to(0), "request priorities are not supported"),
    ("spaces_between_special_tokens", equal_to(True),
     "spaces_between_special_tokens false is not supported"),
    ("return_tokens_as_token_ids", equal_to(False), "return_tokens_as_token_ids is not supported"),
    ("return_token_ids", equal_to(False), "return_token_ids is not supported"),
    ("detokenize", equal_to(True), "detokenize false is not supported"),
    ("cache_salt", never, "cache_salt is not supported"),
    ("kv_transfer_params", never, "KV transfer is not supported"),
    ("vllm_xargs", never, "vllm_xargs is not supported"),
    ("logits_processors", never, "custom logits processors are not supported"),
    ("mm_processor_kwargs", never, "this model takes text only"),
    ("store", equal_to(False), "responses are not stored by this server"),
    ("metadata", is_empty, "metadata applies to stored responses, which this server does not "
                           "keep"),
    ("service_tier", lambda v: v in ("auto", "default"), "service tiers are not supported"),
    ("prediction", never, "predicted outputs are not supported"),
    ("audio", never, "this model answers in text only"),
    ("modalities", lambda v: v == ["text"], "this model answers in text only"),
    ("web_search_options", never, "web search is not supported"),
    ("functions", never, "the legacy `functions` field is not supported; use `tools`"),
    ("function_call", never, "the legacy `function_call` field is not supported; use "
                             "`tool_choice`"),
    ("reasoning_effort", never, "reasoning_effort is not supported by this model"),
    ("verbosity", never, "verbosity is not supported"),
    ("documents", never, "documents are not supported"),
)


# the sampling fields a request may leave to the generation config's defaults
GENERATION_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


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
    repetition_penalty: float | None = Field(None, gt=0)
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

    @classmethod
    def refused_field_names(cls) -> frozenset[str]:
        return frozenset(name for name, _, _ in UNSUPPORTED_FIELDS + cls.unsupported)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "unsupported", "{param}: {why}", {"param": "stream_options", "why": (
                    "stream options can only be given when stream is true")})
        return self

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
                        seed_offset: int = 0,
                        defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
        """The engine's SamplingParams of this request (`seed_offset`: the sample's index
        among n, added to a given seed so that each sample is reproducible alone). A sampling
        field the request leaves out takes `defaults` (the model's generation config,
        `engine.generation_config`), else SamplingParams' own default."""
        seed = None if self.seed is None else self.seed + seed_offset
        chosen = {name: getattr(self, name) for name in GENERATION_DEFAULTED
                  if getattr(self, name) is not None}
        sampling = {**(defaults or {}), **chosen}
        sampling.pop("max_tokens", None)  # the caller's max_tokens has taken its default
        return SamplingParams(
            max_tokens=max_tokens, **sampling, seed=seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens,
            logit_bias=token_id_keys("logit_bias", self.logit_bias),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, output_kind=output_kind,
            structured_outputs=structured_outputs)


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


class PromptLogprob(ResponseModel):
    """vLLM's logprob entry of one token at a prompt position."""

    logprob: float
    rank: int | None = Field(None, description="1 is the most likely token; null where the "
                             "token is not among the top ones asked for")
    decoded_token: str | None = None


# per prompt position (the first is null): token id -> its entry
PromptLogprobs = list[dict[int, PromptLogprob] | None]
