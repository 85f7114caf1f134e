"""What a launched step leaves for the host, and its results as Python values.

`ModelRunner.launch` (runner.py) enqueues a step and returns a `PendingStep`: host tensors that
its device-to-host copies fill, valid once its event completes. `collect_results` waits for
them and turns them into a `StepResult` for the engine core: one sampled token per sampler,
logprobs, and under speculative decoding the verified runs of tokens, rejected counts and
the next drafts (spec_decode.py).
"""

from dataclasses import dataclass, field

import torch

from mlaserve.engine.input_batch import RunnerRequest
from mlaserve.engine.spec_decode import EmittedLogprobs, Verification, Verified


@dataclass
class StepResult:
    """What a step produced, on the host."""

    sampled: list[int]  # one new token id per request of the plan's `sampling`, in order
    logprobs: dict[str, dict[int, float]]  # request id -> {token: logprob} of the new token
    prompt_logprobs: dict[str, list[dict[int, float]]]  # request id -> entries in order
    # speculative decoding: request id -> the tokens a verifying request emits after its
    # first (its accepted drafts past the first token, and the bonus or recovered one), how
    # many of its verified drafts were rejected, and each speculating sampler's next drafts
    more_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_rejected: dict[str, int] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    more_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)


NO_SAMPLES = torch.empty(0, dtype=torch.int64)  # a step's samples when it has no plain sampler


@dataclass
class PendingStep:
    """A launched step: its results as host tensors, valid once `ready` has completed."""

    sampled: torch.Tensor  # [S] int64
    logprobs: tuple[list[RunnerRequest], torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    prompt_logprobs: list[tuple[RunnerRequest, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor]] = field(default_factory=list)
    ready: torch.cuda.Event | None = None
    # speculative decoding: the plan's sampler ids in order, the plain samplers' ids (the rows
    # of `sampled`); host copies of the verification (the verifying requests' ids, tokens
    # [N, k + 1], counts [N], draft counts), of the logprobs of verified positions, and of the
    # drafts [S', k] of the drafting samplers (their ids)
    sampling_ids: list[str] = field(default_factory=list)
    plain_ids: list[str] = field(default_factory=list)
    verified: tuple[list[str], torch.Tensor, torch.Tensor, list[int]] | None = None
    verified_logprobs: EmittedLogprobs | None = None
    drafts: tuple[list[str], torch.Tensor] | None = None


def collect_results(pending: PendingStep, rank: int) -> StepResult:
    """Wait for a launched step's copies; its results as Python values. Under tensor
    parallelism rank 0 samples and verifies: the other ranks' speculative results are not read
    (nor built)."""
    if pending.ready is not None:
        pending.ready.synchronize()
    plain_sampled = pending.sampled.tolist()  # the rows of `sampled`: the plain samplers'
    result = StepResult(plain_sampled, {}, {})
    if pending.logprobs is not None:
        samplers, chosen, values, ids = pending.logprobs
        chosen, values, ids = chosen.tolist(), values.tolist(), ids.tolist()
        for i, request in enumerate(samplers):
            n = request.params.logprobs
            if n is None:
                continue
            entry = dict(zip(ids[i][:n], values[i][:n], strict=True))
            entry[plain_sampled[i]] = chosen[i]
            result.logprobs[request.request_id] = entry
    if pending.sampling_ids and rank == 0:  # a speculating engine's step
        _speculative_results(pending, result)
    for request, chosen, values, ids, targets in pending.prompt_logprobs:
        chosen, values, ids, targets = (chosen.tolist(), values.tolist(), ids.tolist(),
                                        targets.tolist())
        entries = []
        for j in range(len(targets)):
            entry = dict(zip(ids[j], values[j], strict=True))
            entry[targets[j]] = chosen[j]
            entries.append(entry)
        result.prompt_logprobs[request.request_id] = entries
    return result


def _speculative_results(pending: PendingStep, result: StepResult) -> None:
    """Fill a speculating step's result: every sampler's first token in the plan's order (a
    plain sample or a verified run's first), the verified runs' further tokens, rejected
    counts and logprobs, and the next drafts."""
    plain = dict(zip(pending.plain_ids, result.sampled, strict=True))
    verified: dict[str, Verified] = {}
    if pending.verified is not None:
        request_ids, tokens, emitted, num_drafts = pending.verified
        verified = dict(zip(request_ids, Verification.outcomes(tokens, emitted, num_drafts),
                            strict=True))
    result.sampled = [plain[i] if i in plain else verified[i].tokens[0]
                      for i in pending.sampling_ids]
    for request_id, outcome in verified.items():
        result.more_tokens[request_id] = outcome.tokens[1:]
        result.num_rejected[request_id] = outcome.num_drafts + 1 - len(outcome.tokens)
    if pending.verified_logprobs is not None:
        for request_id, entries in pending.verified_logprobs.entries(verified).items():
            result.logprobs[request_id] = entries[0]
            result.more_logprobs[request_id] = entries[1:]
    if pending.drafts is not None:
        request_ids, drafts = pending.drafts
        result.drafts = dict(zip(request_ids, drafts.tolist(), strict=True))
