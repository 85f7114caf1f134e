"""The step plan: one engine step as a value, which every rank's runner executes.

The scheduler decides a step over the core's `Request`s (a `ScheduledBatch`); `PlanBuilder`
turns it into a `StepPlan`, which names requests by id and carries only what changed since the
previous plan: the requests that left the runners' batch (finished, aborted, preempted, or taken
back after a failed step), the requests that join it (prompt ids, sampling parameters, seed,
EOS ids), and for each scheduled request its computed tokens, its new tokens this step, the
output ids and block ids the runners have not seen yet (after how many of the ids they hold to
keep, where rejected drafts gave blocks back) and its placeholders (tokens sampled on the
device, not yet known on the host); then which requests sample, in logits-row order.

A `ModelRunner` (runner.py) keeps its own state per request id from the plans it executes. In
one process the core hands each plan to its runner as it is; under tensor parallelism it also
broadcasts the plan, msgspec-encoded, to the replica's other ranks, whose runners execute the
same plan (worker.py): the same forward and the same collectives in the same order. An `idle`
plan has no batch (the runner joins the other replicas' expert exchanges, data_parallel.py); a
`shutdown` plan ends a worker. Under expert parallelism a plan also carries the step's exchange
capacity, which every replica agreed on.
"""

import msgspec

from mlaserve.engine.request import Request, SamplingParams


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the runners do not hold yet (new, or back after leaving)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_seed: int
    eos_token_ids: list[int]


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One scheduled request's state as the runners read it at launch."""

    request_id: str
    num_computed_tokens: int  # a decode computes this position; a prefill chunk starts here
    num_new_tokens: int  # 1 for a decode
    new_token_ids: list[int] = msgspec.field(default_factory=list)  # known outputs not sent yet
    num_output_placeholders: int = 0
    new_block_ids: list[int] = msgspec.field(default_factory=list)  # block ids not sent yet
    num_prompt_logprobs: int = -1  # prompt positions scored so far (the core's); -1: none asked
    # a decode's drafts that this step verifies (speculative decoding): its input tokens after
    # its own, at the positions after it; or, pipelined, how many drafts the previous launch
    # left on the device (they, the input token before them, and how many of the previous
    # step's drafts were rejected, which moves these positions back, come from there)
    draft_token_ids: list[int] = msgspec.field(default_factory=list)
    num_device_drafts: int = 0
    # blocks given back since the last plan (rejected drafts): the runners keep their first
    # num_kept_blocks block ids before taking new_block_ids; -1: keep all
    num_kept_blocks: int = -1


class StepPlan(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step, as every rank executes it (see the module docstring)."""

    finished: list[str] = msgspec.field(default_factory=list)  # left the batch since the last
    new_requests: list[NewRequest] = msgspec.field(default_factory=list)
    decodes: list[ScheduledRequest] = msgspec.field(default_factory=list)
    prefills: list[ScheduledRequest] = msgspec.field(default_factory=list)
    sampling: list[str] = msgspec.field(default_factory=list)  # ids, in logits-row order
    idle: bool = False  # no batch: join the other replicas' expert exchanges
    # under expert parallelism the rows per rank of the step's expert exchanges, agreed by the
    # replicas (`Lockstep.agree_capacity`); 0 without expert parallelism
    expert_capacity: int = 0
    shutdown: bool = False  # a worker's last plan

    @property
    def request_ids(self) -> list[str]:
        """The scheduled requests' ids: decodes, then prefills."""
        return [s.request_id for s in (*self.decodes, *self.prefills)]


class PlanBuilder:
    """The core's record of what the runners hold, and the plans that keep them in step.

    Per request id the runners hold: how many of its output ids and block ids were sent.
    """

    def __init__(self) -> None:
        self._sent: dict[str, list[int]] = {}  # request id -> [outputs sent, blocks sent]
        self._finished: list[str] = []

    @property
    def leaving(self) -> list[str]:
        """Ids the next plan tells the runners to drop."""
        return self._finished

    def release(self, request_id: str) -> None:
        """The request left the runners' batch: the next plan tells them."""
        if self._sent.pop(request_id, None) is not None:
            self._finished.append(request_id)

    def restore(self, plan: StepPlan) -> None:
        """A plan whose launch failed may not have reached the runner: its leaving ids go out
        again with the next plan (a runner drops an id it does not hold as nothing). Its
        scheduled requests are released by the core's take-back and sent anew."""
        self._finished[:0] = plan.finished

    def plan(self, decodes: list[Request], prefills: list[tuple[Request, int]],
             sampling: list[Request], expert_capacity: int = 0) -> StepPlan:
        """The plan of a scheduled step (its requests' progress as the scheduler left it,
        before `Scheduler.advance`)."""
        new_requests: list[NewRequest] = []
        plan = StepPlan(self._finished, new_requests,
                        [self._scheduled(r, 1 + r.num_scheduled_drafts, new_requests,
                                         [] if r.drafts_on_device
                                         else r.draft_token_ids[:r.num_scheduled_drafts],
                                         r.num_scheduled_drafts if r.drafts_on_device else 0)
                         for r in decodes],
                        [self._scheduled(r, n, new_requests) for r, n in prefills],
                        [r.request_id for r in sampling], expert_capacity=expert_capacity)
        self._finished = []
        return plan

    def idle(self, expert_capacity: int) -> StepPlan:
        """A plan without a batch: this replica joins the others' expert exchanges of
        `expert_capacity` rows per rank."""
        plan = StepPlan(self._finished, idle=True, expert_capacity=expert_capacity)
        self._finished = []
        return plan

    def _scheduled(self, request: Request, num_new_tokens: int,
                   new_requests: list[NewRequest],
                   draft_token_ids: list[int] | None = None,
                   num_device_drafts: int = 0) -> ScheduledRequest:
        sent = self._sent.get(request.request_id)
        if sent is None:
            sent = self._sent[request.request_id] = [0, 0]
            new_requests.append(NewRequest(
                request.request_id, request.prompt_token_ids, request.params,
                request.sample_seed, list(request.eos_token_ids)))
        outputs, blocks = request.output_token_ids, request.block_ids
        num_kept_blocks = -1
        if request.num_blocks_kept is not None:  # the ids past it may be other requests' now
            num_kept_blocks = sent[1] = min(sent[1], request.num_blocks_kept)
            request.num_blocks_kept = None
        if len(blocks) < sent[1]:
            raise RuntimeError(f"request {request.request_id} lost blocks without leaving the "
                               "runners' batch")
        scheduled = ScheduledRequest(
            request.request_id, request.num_computed_tokens, num_new_tokens,
            outputs[sent[0]:],
            request.num_output_placeholders + request.num_draft_placeholders,
            blocks[sent[1]:],
            -1 if request.prompt_logprobs is None else len(request.prompt_logprobs),
            draft_token_ids or [], num_device_drafts, num_kept_blocks)
        sent[0], sent[1] = len(outputs), len(blocks)
        return scheduled
