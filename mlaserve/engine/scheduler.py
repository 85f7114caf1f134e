"""Token-budget continuous batching: decodes first, then chunked prefills; preemption by recompute.

Prefix caching: a request admitted with nothing computed first takes the cached blocks of its
longest cached prefix (see cache/block_pool.py) and starts its prefill after them.

Each step has a budget of `max_num_batched_tokens`. Running requests are served first, in the
order they were admitted (a decode costs one token, an unfinished prompt takes what is left of the
budget); then waiting requests are admitted first-come-first-served while the budget, the KV pool
and `max_num_seqs` allow. When a running request needs a block and none is free, the most recently
admitted running request is preempted: its blocks are freed and it waits to be recomputed.

Steps are pipelined (see core.py): a step is scheduled while the one before it still runs, so a
request may own tokens that were sampled on the device but not yet seen here (placeholders). They
count as tokens for scheduling: a decode's input may be such a token (the runner takes it from
the device). A request whose placeholders already reach `max_tokens` or `max_model_len` is not
scheduled again, and a preempted request waits until its placeholders have landed. Only EOS and
stop tokens, seen a step late, cost one wasted decode row. A step that fails is taken back with
`retreat` (its tokens count as not computed, its placeholders as never sampled).

A waiting request whose next uncached block is being computed by a running request (the same
prompt prefix arriving together, e.g. the n samples of one prompt) waits until that block is
computed and cached, then takes it from the cache instead of computing it again.

Speculative decoding (engine/speculative.py): a running request with drafts decodes its next
token and verifies up to all its drafts in one step (a decode of 1 + d tokens: d is cut to the
budget, to max_tokens and to max_model_len), and a speculating request owns blocks for
`num_speculative_tokens - 1` positions past its step's tokens, which the MTP module's later
drafts write. When the step lands, the positions of rejected drafts count as not computed again
(`land`'s `num_rejected`), and whole blocks past the request's tokens and lookahead go back to
the pool. Pipelined, a request whose step is still on the device verifies the k drafts that
step makes (`drafts_on_device`: the runner takes them, its next input token and its rejected
count from the device) or, where k do not fit, waits a step; until a step lands its drafts
count as accepted (`num_draft_placeholders`: the most it can emit).

A waiting request for which `waits_for_grammar` holds (its structured-output grammar is still
compiling, see structured.py) is skipped: it keeps its place in the queue, and the requests
behind it are admitted meanwhile (vLLM's WAITING_FOR_FSM).
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mlaserve.cache.block_pool import BlockPool
from mlaserve.config import SchedulerConfig
from mlaserve.engine.request import Request, RequestStatus
from mlaserve.engine.speculative import draft_lookahead
from mlaserve.engine.structured import GrammarBitmask


@dataclass
class ScheduledBatch:
    """One step's work: (request, new token count) pairs; decodes have exactly one new token."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # the requests that sample a token this step, in logits-row order (decodes, then prefills
    # whose chunk reaches the end of their known tokens)
    sampling_requests: list[Request] = field(default_factory=list)
    is_advanced: bool = False  # counted by `Scheduler.advance` (and not taken back since)
    # speculative decoding: the drafts each decode verifies, by request id (the requests'
    # num_scheduled_drafts when scheduled; a later schedule overwrites those)
    verified_drafts: dict[str, int] = field(default_factory=dict)
    # token masks of the constrained sampling requests (filled by the core before launch)
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def requests(self) -> list[Request]:
        return [*self.decodes, *(r for r, _ in self.prefills)]

    def subset(self, requests: list[Request]) -> "ScheduledBatch":
        """The same work for only `requests` (each keeps its token count and row order), to run
        again after the step was taken back: a decode that was to verify drafts a step before
        it left on the device (a step taken back too, or landed since) decodes its next token
        alone instead."""
        keep = set(requests)  # Requests hash by identity
        decodes = [r for r in self.decodes if r in keep]
        for request in decodes:
            if request.drafts_on_device:
                request.drafts_on_device, request.num_scheduled_drafts = False, 0
        return ScheduledBatch(
            decodes=decodes,
            prefills=[(r, n) for r, n in self.prefills if r in keep],
            sampling_requests=[r for r in self.sampling_requests if r in keep],
            grammar_bitmask=self.grammar_bitmask)  # rows found by request id


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool,
                 num_speculative_tokens: int = 0) -> None:
        self.config = config
        self.pool = pool
        self.num_speculative_tokens = num_speculative_tokens  # k; 0: no speculation
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # whether a waiting request may not be admitted yet (its grammar compiles)
        self.waits_for_grammar: Callable[[Request], bool] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _lookahead(self, request: Request) -> int:
        """Positions past a step's tokens that the MTP module's drafts of the step write."""
        return draft_lookahead(self.num_speculative_tokens) if request.speculates else 0

    def _num_drafts(self, request: Request, budget: int, available: int) -> int:
        """How many of a decoding request's `available` drafts its step verifies: as many as
        fit the token budget beside its own token, and emit no token past max_tokens or
        max_model_len."""
        return max(0, min(available, budget - 1,
                          request.params.max_tokens - request.num_output_tokens_total - 1,
                          self.config.max_model_len - 1 - request.num_total_tokens))

    def _reserve(self, request: Request, num_new_tokens: int) -> bool:
        """Make sure the request owns blocks for its first num_computed + num_new tokens (and
        its lookahead)."""
        needed = self.pool.blocks_for(request.num_computed_tokens + num_new_tokens
                                      + self._lookahead(request))
        extra = needed - len(request.block_ids)
        if extra <= 0:
            return True
        if extra > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(extra))
        return True

    def _release_blocks(self, request: Request) -> None:
        self.pool.free_blocks(request.block_ids[::-1])  # tail first onto the LRU list
        request.block_ids = []
        request.num_registered_blocks = 0
        request.num_blocks_kept = None  # it leaves the runners' batch: they drop every id

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_blocks(request)
        request.num_computed_tokens = 0
        request.num_scheduled_drafts = 0
        request.draft_token_ids = []  # drafted over a cache it no longer has
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        scheduled: set[Request] = set()
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._done_once_landed(request):
                continue
            remaining = request.num_total_tokens - request.num_computed_tokens
            if remaining <= 0:
                continue
            count = min(remaining, budget)
            request.num_scheduled_drafts, request.drafts_on_device = 0, False
            if remaining == 1 and request.num_output_placeholders and request.speculates:
                # its step in flight drafts k tokens on the device: verify them all (decode
                # rows of q_len k + 1), or wait a step for them to land
                k = self.num_speculative_tokens
                if self._num_drafts(request, budget, k) < k:
                    continue
                request.num_scheduled_drafts, request.drafts_on_device = k, True
                count += k
            elif remaining == 1 and request.draft_token_ids:
                request.num_scheduled_drafts = self._num_drafts(
                    request, budget, len(request.draft_token_ids))
                count += request.num_scheduled_drafts
            while not self._reserve(request, count):
                victim = next(r for r in reversed(self.running) if r not in scheduled)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            scheduled.add(request)
            budget -= count
            if remaining == 1:  # with its drafts, if any
                batch.decodes.append(request)
            else:
                batch.prefills.append((request, count))
        if batch.preempted:
            return self._with_samplers(batch)
        skipped: list[Request] = []  # waiting for grammars or shared blocks: keep their places
        in_progress = self._blocks_in_progress() if self.waiting else set()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.waits_for_grammar is not None and self.waits_for_grammar(request):
                skipped.append(self.waiting.popleft())
                continue
            if request.num_output_placeholders:
                break  # preempted with a token still on the device: recompute once it lands
            # prompt logprobs need every position's logits, so those requests skip the cache
            uses_cache = request.num_computed_tokens == 0 and request.params.prompt_logprobs is None
            # a prompt (or a recompute) has no drafts
            request.num_scheduled_drafts, request.drafts_on_device = 0, False
            if uses_cache and self._next_block_in_progress(request, in_progress):
                skipped.append(self.waiting.popleft())
                continue
            if uses_cache:
                request.block_ids = self.pool.lookup_prefix(request.all_token_ids,
                                                            request.block_hashes)
                request.num_computed_tokens = len(request.block_ids) * self.pool.block_size
                request.num_cached_tokens = request.num_computed_tokens
                request.num_registered_blocks = len(request.block_ids)
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, count):
                self._release_blocks(request)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            in_progress.update(request.block_hashes[request.num_registered_blocks:])
            budget -= count
            if count == 1 and request.num_tokens - request.num_computed_tokens == 1:
                batch.decodes.append(request)
            else:
                batch.prefills.append((request, count))
        self.waiting.extendleft(reversed(skipped))
        return self._with_samplers(batch)

    def _blocks_in_progress(self) -> set:
        """Hashes of the full prompt blocks that running requests have yet to compute and
        cache."""
        if not self.pool.enable_prefix_caching:
            return set()
        return {h for r in self.running for h in r.block_hashes[r.num_registered_blocks:]}

    def _next_block_in_progress(self, request: Request, in_progress: set) -> bool:
        """Whether the first block of `request` that the cache misses is one a running request
        is computing now (then it is cheaper to wait a step for it)."""
        if not in_progress:
            return False
        hits = self.pool.prefix_hits(request.all_token_ids, request.block_hashes)
        return len(hits) < len(request.block_hashes) and \
            request.block_hashes[len(hits)] in in_progress

    @staticmethod
    def _with_samplers(batch: ScheduledBatch) -> ScheduledBatch:
        batch.sampling_requests = [*batch.decodes, *(
            r for r, count in batch.prefills
            if r.num_computed_tokens + count == r.num_total_tokens)]
        return batch

    def _done_once_landed(self, request: Request) -> bool:
        """Whether the tokens still on the device already end the request by length."""
        if not request.num_output_placeholders:
            return False
        return (request.num_output_tokens_total >= request.params.max_tokens
                or request.num_total_tokens >= self.config.max_model_len)

    def advance(self, batch: ScheduledBatch) -> None:
        """Count a launched step's tokens as computed and its samples (and verified drafts,
        as if accepted) as placeholders."""
        batch.is_advanced = True
        for request in batch.decodes:
            drafts = batch.verified_drafts[request.request_id] = request.num_scheduled_drafts
            request.num_computed_tokens += 1 + drafts
            request.num_draft_placeholders += drafts
        for request, count in batch.prefills:
            request.num_computed_tokens += count
        for request in batch.sampling_requests:
            request.num_output_placeholders += 1

    def retreat(self, batch: ScheduledBatch) -> None:
        """Undo `advance` for a step that failed: its tokens are computed again later.

        A request preempted since the step was scheduled has nothing computed to give back.
        A no-op for a step that was not advanced (its launch failed) or was taken back already.
        """
        if not batch.is_advanced:
            return
        batch.is_advanced = False
        for request in batch.decodes:
            drafts = batch.verified_drafts[request.request_id]
            request.num_draft_placeholders -= drafts
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens -= 1 + drafts
        for request, count in batch.prefills:
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens -= count
        for request in batch.sampling_requests:
            request.num_output_placeholders -= 1

    def land(self, request: Request, num_drafts: int = 0, num_rejected: int = 0) -> None:
        """One placeholder of the request (and the num_drafts drafts its step verified) became
        known tokens (or was dropped); num_rejected of those drafts were rejected: their
        positions count as not computed, and whole blocks past the request's tokens and
        lookahead go back to the pool."""
        request.num_output_placeholders -= 1
        request.num_draft_placeholders -= num_drafts
        if request.status != RequestStatus.RUNNING:
            return
        if num_rejected:
            request.num_computed_tokens -= num_rejected
            keep = self.pool.blocks_for(request.num_computed_tokens + 1
                                        + self._lookahead(request))
            if len(request.block_ids) > keep:
                self.pool.free_blocks(request.block_ids[keep:][::-1])  # tail first
                del request.block_ids[keep:]
                kept = request.num_blocks_kept
                request.num_blocks_kept = keep if kept is None else min(kept, keep)
        self.cache_computed_blocks(request)

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request's blocks and forget it."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release_blocks(request)
        request.status = RequestStatus.FINISHED

    def cache_computed_blocks(self, request: Request) -> None:
        """Enter the request's newly computed full blocks of known tokens into the prefix
        cache."""
        computed = min(request.num_computed_tokens, request.num_tokens)
        if not self.pool.has_new_full_blocks(computed, request.num_registered_blocks):
            return  # most decode steps: no need to join the prompt and output token lists
        request.num_registered_blocks = self.pool.cache_full_blocks(
            request.all_token_ids, request.block_ids, computed, request.block_hashes,
            request.num_registered_blocks)
