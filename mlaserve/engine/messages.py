"""What crosses the boundary between a frontend (the API server, `LLM`) and the engine core.

The core takes token ids and sampling parameters and gives back only what is new each step:
token ids, their logprobs, and a finish reason when a request ends. Text is the frontend's
business (detokenization, stop strings). Every message is a msgspec Struct (or a dataclass that
msgspec encodes), so the same objects travel in-process and, msgpack-encoded, between processes.
"""

import msgspec

from mlaserve.engine.request import SamplingParams, is_int, shown
from mlaserve.engine.structured import validate_structured_outputs
from mlaserve.engine.structured_config import StructuredOutputsConfig

Logprobs = list[dict[int, float]]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request for the core: validated and tokenized by the frontend."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_seed: int  # the seed of its sampling noise (params.seed, or one the frontend drew)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in one step (a delta, never the whole list so far).

    `prompt_logprobs` arrive once, with the request's first output; `error` is set when a step
    that carried this request alone failed (the request is then finished with reason "abort";
    see core.py on how a failed step's requests are re-run apart), and when the core refused
    the request: then `rejected` is set too (the request itself is at fault, e.g. a constraint
    that does not compile; a server answers it as a client error, 400).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    queued_time: float | None = None  # with the first output: seconds waiting in the core
    rejected: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """Gauges and counters of the core after a step (for /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    # speculative decoding's counters (engine/speculative.py `SpecDecodeStats`)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)


class EngineInfo(msgspec.Struct):
    """What a frontend needs to know of the core to validate requests before sending them."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # num_blocks * block_size
    eos_token_ids: list[int]
    attention_backend: str
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()  # the limits


def validate_prompt(token_ids: list[int], params: SamplingParams, info: EngineInfo) -> None:
    """Raise ValueError, saying what to change, for a request the core could never serve.

    Checks the parameters (`SamplingParams.validate`) and everything that depends on the model:
    prompt, stop and logit_bias token ids inside the vocabulary, logprob counts no larger than
    it, the prompt plus `max_tokens` inside `max_model_len` and the KV cache, and a structured
    outputs constraint within the server's limits (structured_config.py; nothing parses it
    here: the grammar sandbox does, and refuses an invalid one as the request's error).
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    params.validate()
    if params.n != 1:
        raise ValueError(f"n={params.n}: the engine runs one sample a request; LLM.generate "
                         "and the server's `n` run n requests")
    if not isinstance(token_ids, list):
        raise ValueError(f"the prompt must be a list of token ids, got {type(token_ids).__name__}")
    if not token_ids:
        raise ValueError("the prompt is empty; give at least one token")
    vocab_size = info.vocab_size
    bad = [t for t in token_ids if not is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}) (the "
                         f"model's vocabulary); got {shown(bad[:5], 80)}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size}) (the model's "
                         f"vocabulary); got {shown(bad[:5], 80)}")
    bad = [t for t in params.logit_bias or {} if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}) (the model's "
                         f"vocabulary); got {shown(bad[:5], 80)}")
    for name in ("logprobs", "prompt_logprobs"):
        count = getattr(params, name)
        if count is not None and count > vocab_size:
            raise ValueError(f"{name} must be at most the vocabulary size {vocab_size}, "
                             f"got {count}")
    if len(token_ids) > info.max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                         f"{info.max_model_len}; shorten it or raise max_model_len")
    total = len(token_ids) + params.max_tokens
    if total > info.max_model_len:
        raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens "
                         f"({params.max_tokens}) = {total} exceeds max_model_len="
                         f"{info.max_model_len}; lower max_tokens or raise max_model_len")
    if total > info.kv_capacity_tokens:
        raise ValueError(f"prompt + max_tokens = {total} tokens cannot fit the KV cache "
                         f"({info.kv_capacity_tokens} tokens); lower max_tokens or add KV "
                         "blocks")
    if params.structured_outputs is not None:  # last: it reads the constraint's whole text
        validate_structured_outputs(params.structured_outputs, vocab_size,
                                    info.structured_outputs)
