"""Speculative decoding with the model's own multi-token-prediction (MTP) module: the options,
which requests speculate, and the acceptance counters.

The method, as vLLM's `--speculative-config '{"method": "deepseek_mtp",
"num_speculative_tokens": k}'` spells it: after each step the MTP module (the checkpoint's layer
`num_hidden_layers`, `model/mtp.py`) drafts k tokens per speculating request, greedily (its
argmax), applied to its own output for k > 1; the next step verifies them in the same forward
that computes the request's next position (its k + 1 positions as one chunk), and the rejection
rule (`rejection_sampler.py`) keeps an accepted prefix and emits one more token, so that the
output is distributed exactly as without speculation (greedy: identical).

Which requests speculate (`speculates`): the verification's target distributions apply each
request's penalties, logit bias, min_tokens and structured-output grammar with its drafts before
a position counted as generated (a grammar's mask at each position is its state after those
drafts; `StructuredOutputManager.grammar_bitmask`), and logprobs are reported for every token
emitted, from the verification's logits. Two kinds of request decode one token a step as
without speculation (the same output; only the speed differs): a grammar that starts after a
token (`after_token_id`: the drafts may hold that token), and a grammar with min_tokens (its
"must end" rule reads the mask of the next position only).
"""

from dataclasses import dataclass, field
from typing import Any

from mlaserve.engine.request import SamplingParams

METHODS = ("deepseek_mtp", "mtp")  # vLLM's names of the same method
MAX_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`: the drafting method and the drafts per step (k)."""

    method: str = "deepseek_mtp"
    num_speculative_tokens: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is not served; use "
                             f"one of {', '.join(METHODS)} (the checkpoint's MTP module)")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer "
                             f"from 1 to {MAX_SPECULATIVE_TOKENS}, got {k!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SpeculativeConfig":
        """From vLLM's JSON object; unknown keys are refused by name."""
        if not isinstance(values, dict):
            raise ValueError("speculative_config must be a JSON object, e.g. "
                             '{"method": "deepseek_mtp", "num_speculative_tokens": 1}')
        unknown = sorted(set(values) - {"method", "num_speculative_tokens", "model"})
        if unknown:
            raise ValueError(f"speculative_config: unknown or unserved field(s) {unknown}; "
                             "this engine takes method and num_speculative_tokens")
        values = {k: v for k, v in values.items() if k != "model"}  # the MTP module is the model's
        return cls(**values)


def draft_lookahead(num_speculative_tokens: int) -> int:
    """Positions past a speculating step's tokens that its MTP drafts write (the k - 1
    recursive passes'; 0 without speculation): the blocks a request owns cover them, and so
    does the runner's block table, past max_model_len too."""
    return max(num_speculative_tokens - 1, 0)


def speculates(params: SamplingParams) -> bool:
    """Whether a request with these parameters drafts and verifies (module docstring)."""
    constraint = params.structured_outputs
    return constraint is None or (constraint.after_token_id is None and not params.min_tokens)


@dataclass
class SpecDecodeStats:
    """Counters over the engine's life, named as vLLM's `vllm:spec_decode_*` metrics."""

    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at draft i
    num_drafts: int = 0  # verification rows (a request's drafts of one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe(self, num_drafted: int, num_accepted: int, k: int) -> None:
        """One request's verification: `num_accepted` of its `num_drafted` drafts held."""
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: 1 + accepted drafts (vLLM's definition); 0 without
        drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        """The share of verifications whose draft at each position was accepted."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    def since(self, earlier: "SpecDecodeStats") -> "SpecDecodeStats":
        """The counts between an earlier reading of the same counters and this one (an
        earlier reading before any step may have no positions yet)."""
        before = earlier.accepted_per_pos or [0] * len(self.accepted_per_pos)
        return SpecDecodeStats([a - b for a, b in zip(self.accepted_per_pos, before, strict=True)],
                               self.num_drafts - earlier.num_drafts,
                               self.num_draft_tokens - earlier.num_draft_tokens,
                               self.num_accepted_tokens - earlier.num_accepted_tokens)
