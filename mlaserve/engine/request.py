"""SamplingParams, RequestOutput (the public types) and Request (the engine's state per request).

`SamplingParams.validate` is the door: every field is checked for its type, its range and (floats)
finiteness, so that nothing a request carries can make a batched step raise or produce NaNs in
another request's row. The checks that need the model (token ids against the vocabulary) are in
`messages.validate_prompt`.
"""

import enum
import logging
import math
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

OUTPUT_KINDS = ("cumulative", "delta", "final_only")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MIN_TEMPERATURE = 1e-2  # lower positive temperatures are raised to this (as vLLM does)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty (OpenAI's range)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range for each logit_bias value


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON true is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value: object, limit: int = 40) -> str:
    """A short repr for an error message (a huge int or a long list is cut)."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's int -> str digit limit
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_int(name: str, value: object, low: int, high: int = INT64_MAX,
               note: str = "") -> None:
    """ValueError unless `value` is an int in [low, high]."""
    if not is_int(value) or not low <= value <= high:
        lower = "-2**63" if low == INT64_MIN else str(low)
        upper = "2**63 - 1" if high == INT64_MAX else str(high)
        raise ValueError(f"{name} must be an integer in [{lower}, {upper}]{note}, "
                         f"got {shown(value)}")


def _check_float(name: str, value: object, low: float, high: float, *,
                 low_open: bool = False, note: str = "") -> None:
    """ValueError unless `value` is a finite number in [low, high] (or (low, high])."""
    try:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and (low < value if low_open else low <= value)
              and value <= high)
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a finite number in {interval}{note}, got {shown(value)}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {shown(value)}")


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputs:
    """A constraint on the generated text, as vLLM's structured outputs define it; exactly one
    kind is set.

    json: a JSON schema, as JSON text. json_object: any JSON object. regex: a regular
    expression the whole output matches. choice: the output is one of these strings. grammar:
    an EBNF grammar (the dialect the grammar library reads).
    after_token_id: the constraint starts after this token is generated (e.g. the end of a
    reasoning section, `</think>`); None: from the first generated token.
    disable_any_whitespace: JSON (json, json_object) in compact form, without whitespace between
    tokens (vLLM's option of that name); False allows whitespace (each run of it bounded, see
    `grammars.MAX_WHITESPACE_RUN`); None takes the server's `structured_outputs_config` setting
    (compact unless set otherwise), resolved at the door (`validate_structured_outputs`).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    after_token_id: int | None = None
    disable_any_whitespace: bool | None = None

    def kinds(self) -> list[str]:
        """The kinds that are set (valid constraints have exactly one)."""
        return [kind for kind in STRUCTURED_KINDS
                if getattr(self, kind) not in (None, False)]

    def validate(self) -> None:
        """ValueError unless exactly one kind is set, with a value of the right type."""
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(STRUCTURED_KINDS)}; got {kinds or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings")
        if self.after_token_id is not None:
            _check_int("structured_outputs.after_token_id", self.after_token_id, 0)
        if self.disable_any_whitespace is not None:
            _check_bool("structured_outputs.disable_any_whitespace",
                        self.disable_any_whitespace)


@dataclass
class SamplingParams:
    """How to sample one request. temperature 0 is greedy.

    top_k: -1 or 0 is off; a value above the vocabulary size keeps every token (as in vLLM).
    A temperature in (0, 0.01) is raised to 0.01 (as in vLLM: lower ones overflow the logits).
    logit_bias: token id -> value added to its logit before sampling (greedy included), each
    in [-100, 100] as OpenAI defines it.
    structured_outputs: a constraint on the output (`StructuredOutputs`); None: free text.
    logprobs / prompt_logprobs: number of most likely tokens to return per position besides the
    chosen one (0 returns only the chosen token's logprob; None returns none), at most 20.
    output_kind: what each streamed RequestOutput holds: "cumulative" (everything so far),
    "delta" (only what is new since the last output) or "final_only" (one output at the end).
    Construction validates (ValueError naming the field and what it may be).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"
    n: int = 1  # samples of the prompt (`LLM.generate` runs n requests; the engine takes 1)

    def __post_init__(self) -> None:
        if self.stop is None or isinstance(self.stop, str):
            self.stop = [self.stop] if self.stop else []
        if not isinstance(self.stop, (list, tuple)) or not all(
                isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings, got "
                             f"{shown(self.stop)}")
        self.stop = [s for s in self.stop if s]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError("stop_token_ids must be a list of token ids, got "
                             f"{shown(self.stop_token_ids)}")
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g; using %g", self.temperature,
                           MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE

    def validate(self) -> None:
        """Raise ValueError naming the field and what it may be (type, range, finiteness).

        Integers must fit int64 (they travel to the device as int64); floats must be finite
        and fit float32.
        """
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("n", self.n, 1)
        _check_float("temperature", self.temperature, 0.0, FLOAT32_MAX, note=" (0 is greedy)")
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        top_k = self.top_k
        if not is_int(top_k) or not (top_k in (-1, 0) or 1 <= top_k <= INT64_MAX):
            raise ValueError("top_k must be -1 or 0 (off) or an integer in [1, 2**63 - 1] "
                             f"(above the vocabulary size keeps every token), got {shown(top_k)}")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, note=" or null")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a list of strings, got {shown(self.stop)}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list, got {shown(self.stop_token_ids)}")
        for token in self.stop_token_ids:
            _check_int("every stop_token_ids entry", token, 0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to numbers, got "
                                 f"{shown(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                _check_int("every logit_bias key", token, 0, note=" (a token id)")
                _check_float(f"logit_bias[{token}]", bias, *LOGIT_BIAS_RANGE)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise ValueError("structured_outputs must be StructuredOutputs, got "
                                 f"{shown(self.structured_outputs)}")
            self.structured_outputs.validate()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS, note=" or null")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), *PENALTY_RANGE)
        _check_float("repetition_penalty", self.repetition_penalty, FLOAT32_TINY, FLOAT32_MAX,
                     note=" (it divides logits in float32; 1 is off)")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens,
                   note=" (at most max_tokens)")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got "
                             f"{shown(self.output_kind)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


Logprobs = list[dict[int, float]]


@dataclass
class CompletionOutput:
    """vLLM-style view of one completion (`RequestOutput.outputs[0]`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: Logprobs | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """The result (or, while streaming, the state so far) of one request.

    prompt_logprobs[0] is None; prompt_logprobs[i] maps token id -> logprob for prompt token i
    and the k most likely tokens. logprobs holds one such dict per generated token.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: Logprobs | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    output_kind: str = "cumulative"  # what text / token_ids / logprobs hold (SamplingParams)
    # SamplingParams.n > 1 in `LLM.generate`: every sample (the fields above are sample 0's)
    samples: list[CompletionOutput] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The completions, vLLM-style: one, or n with SamplingParams.n."""
        if self.samples is not None:
            return self.samples
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs,
                                 self.stop_reason)]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """The core's state of one request: tokens, blocks, progress and outputs so far (the
    scheduler's, the prefix cache's and the outputs'; a runner keeps its own, from the step
    plans: input_batch.RunnerRequest)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_seed: int
    eos_token_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    num_registered_blocks: int = 0  # full blocks entered into the prefix cache
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # tokens sampled by a step still on the device (pipelined steps): counted, not yet known;
    # under speculative decoding also the drafts such steps verify, counted as if accepted
    # (the most the steps can emit; `Scheduler.land` takes the rejected ones back)
    num_output_placeholders: int = 0
    num_draft_placeholders: int = 0
    # speculative decoding (engine/speculative.py): whether this request drafts, the MTP
    # module's drafts of its next tokens (known, not verified), and how many of them the
    # launched step verifies
    speculates: bool = False
    draft_token_ids: list[int] = field(default_factory=list)
    num_scheduled_drafts: int = 0
    # the scheduled step verifies drafts its predecessor left on the device (pipelined: that
    # step had not landed when this one was scheduled); num_scheduled_drafts counts them
    drafts_on_device: bool = False
    # the fewest blocks it held since its last plan where rejected drafts gave blocks back
    # (the runners drop their ids past it: step_plan.py); None where none were given back
    num_blocks_kept: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)  # when the core received it
    first_scheduled_time: float | None = None  # when a step first computed any of its tokens
    logprobs: Logprobs | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        """Token id at a position of prompt + output, without building the joined list."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else (
            self.output_token_ids[position - n])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def check_stop(self, token: int, max_model_len: int) -> None:
        """Set finish_reason (and stop_reason) if its newest output `token` ends it: a stop
        token or EOS once min_tokens are out, max_tokens, or the model length."""
        params, num_output = self.params, len(self.output_token_ids)
        if num_output >= params.min_tokens and token in params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif (not params.ignore_eos and num_output >= params.min_tokens
              and token in self.eos_token_ids):
            self.finish_reason = "stop"
        elif num_output >= params.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = "length"

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus those sampled (or verified drafts) on the device but not yet seen
        by the host."""
        return self.num_tokens + self.num_output_placeholders + self.num_draft_placeholders

    @property
    def num_output_tokens_total(self) -> int:
        return (len(self.output_token_ids) + self.num_output_placeholders
                + self.num_draft_placeholders)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
