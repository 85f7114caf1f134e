"""The models of the tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) and of the
server-info ones (/v1/models, /version)."""

from typing import Any, Literal

from pydantic import ConfigDict, Field

from mlaserve.server.protocol import NonNegInt, RequestModel, ResponseModel
from mlaserve.server.protocol_chat import ChatCompletionRequest, ChatMessage


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
