"""SamplingParams, RequestOutput (the public types) and Request (the engine's state per request)."""

import enum
from dataclasses import dataclass, field

OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class SamplingParams:
    """How to sample one request. temperature 0 is greedy.

    logprobs / prompt_logprobs: number of most likely tokens to return per position besides the
    chosen one (0 returns only the chosen token's logprob; None returns none).
    output_kind: what each streamed RequestOutput holds: "cumulative" (everything so far),
    "delta" (only what is new since the last output) or "final_only" (one output at the end).
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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed range."""
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1,
             f"top_k must be -1 (off) or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20] or None, got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20] or None, got {self.prompt_logprobs}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
            (self.output_kind in OUTPUT_KINDS,
             f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs,
                                 self.stop_reason)]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Engine-side state of one request: tokens, blocks, progress and outputs so far."""

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
    # tokens sampled by a step still on the device (pipelined steps): counted, not yet known
    num_output_placeholders: int = 0
    batch_row: int | None = None  # row in the runner's persistent batch while it holds one
    num_synced_blocks: int = 0  # block ids already copied into that row's device block table
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

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus those sampled on the device but not yet seen by the host."""
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_output_tokens_total(self) -> int:
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
