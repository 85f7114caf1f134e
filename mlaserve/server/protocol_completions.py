"""The /v1/completions request and response models."""

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from mlaserve.server.protocol import (
    NonNegInt,
    PromptLogprobs,
    ResponseModel,
    SamplingFields,
    UsageInfo,
    is_empty,
)


class CompletionRequest(SamplingFields):
    unsupported: ClassVar = (
        ("suffix", is_empty, "suffix (fill-in-the-middle) is not supported: the model has no "
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
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
