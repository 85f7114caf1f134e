"""Structured outputs: grammar-constrained sampling with xgrammar.

A request's `SamplingParams.structured_outputs` (request.py) names a constraint: a JSON schema, any
JSON object, a regex, a choice of strings or an EBNF grammar. Its life:

- At the door (`validate_structured_outputs`, called by `messages.validate_prompt` in the API
  process, in `LLMEngine` and again in the core): the constraint's fields are checked, then its
  size and shape against the server's limits (`structured_config.check_limits`: bytes, JSON
  depth, alternatives, rules). Nothing parses it there: no text a client writes can make the
  door slow.
- In the core (`StructuredOutputManager`): a constraint not compiled before is compiled first in
  the grammar sandbox (grammar_sandbox.py: a worker process with a time budget and a memory
  cap; a parse error, a timeout or the cap fails the request with a message that names what to
  change), then here against the model's tokenizer (`xgrammar.TokenizerInfo` with the model
  config's vocab_size, which may exceed the tokenizer's length; ids past the tokenizer are never
  allowed), on a thread of its own: those whose trial took less than `QUICK_COMPILE_S` on one,
  the others on another, so a quick compile never waits behind a slow one. Requests with the
  same constraint share one compile (a `GrammarJob`); once all of them are gone, a compile that
  has not started here is cancelled (a trial in progress is killed). Compiled grammars are kept
  in a cache of at most `cache_mb` MiB (xgrammar's own measure of their size). While its grammar
  compiles, a request waits in the scheduler's queue without holding up the requests behind it
  (the scheduler skips it; vLLM's WAITING_FOR_FSM).
- Each step (`StructuredOutputManager.grammar_bitmask`): one matcher per request fills, on the
  host, a token bitmask for the constrained rows that sample; the batched sampler applies it on
  the device (`apply_token_bitmask`) before greedy argmax, the Gumbel pass and the top-k/p path
  alike. Unconstrained rows are untouched. A row whose grammar allows nothing but its end is
  marked `must_end`: min_tokens does not ban EOS there (the constraint ends the request before
  min_tokens, as in vLLM, rather than leaving it no token at all).
- When a step's tokens land (`accept_token`), each constrained request's matcher advances by its
  token. A grammar that has terminated (it accepted a stop token at its end) ends the request
  with finish_reason "stop", as in vLLM. A token the grammar rejects (which the masks above never
  let happen) ends the request with an error.

`after_token_id`: the request samples freely until it generates that token (e.g. `</think>`);
the mask starts with the next token. Pipelining: a constrained request's next bitmask needs its
previous token accepted, so a step carrying one is collected before the next is launched (as for
penalties; see core.py `_needs_known_tokens`).
"""

import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mlaserve.engine.grammar_sandbox import COMPILE_THREADS, GrammarSandbox, TrialResult
from mlaserve.engine.grammars import GrammarKey, error_text, grammar_key, parse_grammar
from mlaserve.engine.request import Request, StructuredOutputs
from mlaserve.engine.structured_config import StructuredOutputsConfig, check_limits
from mlaserve.sandbox_process import trim_heap

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# a grammar whose sandboxed compile took less than this compiles on the quick thread
QUICK_COMPILE_S = 0.5
MAX_TRIAL_RESULTS = 4096  # sandbox verdicts remembered (16-byte keys), so a constraint whose
# compiled grammar left the cache is not tried again
# bitmasks of fewer rows are filled on one thread: a thread pool's hand-off costs more than it
# saves there, and on a CPU device its threads contend with torch's
MIN_ROWS_PER_FILL_THREAD = 64


def validate_structured_outputs(constraint: StructuredOutputs, vocab_size: int,
                                config: StructuredOutputsConfig) -> None:
    """ValueError, saying what is wrong, unless the constraint's fields are valid and within
    the server's limits (nothing is parsed here; the sandbox's parse reports a bad schema).
    A `disable_any_whitespace` left None takes the server's setting here, once."""
    constraint.validate()
    if constraint.disable_any_whitespace is None:
        constraint.disable_any_whitespace = config.disable_any_whitespace
    if constraint.after_token_id is not None and constraint.after_token_id >= vocab_size:
        raise ValueError(f"structured_outputs.after_token_id must be a token id in [0, "
                         f"{vocab_size}) (the model's vocabulary), got {constraint.after_token_id}")
    key = grammar_key(constraint)
    check_limits(key.kind, key.spec, config)


@dataclass
class GrammarBitmask:
    """One step's token masks for its constrained sampling rows, built on the host.

    row_of: request id -> its row in `bitmask`, for the requests whose next token is
    constrained (a request verifying d drafts: the first of its d + 1 rows, one per position).
    bitmask: [M, ceil(V / 32)] int32; bit j of word w allows token 32 * w + j.
    must_end: ids of the requests whose mask allows only the grammar's stop tokens (its end):
    min_tokens does not ban those there.
    """

    row_of: dict[str, int]
    bitmask: torch.Tensor
    must_end: set[str] = field(default_factory=set)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens of the constrained rows -> -inf; the other rows are untouched.

    logits [N, V] float32, rows [M] int64 (rows of `logits`), bitmask [M, ceil(V / 32)] int32,
    all on the same device; returns new logits [N, V] (the input is not modified).
    """
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    masked = logits[rows].masked_fill(allowed == 0, float("-inf"))  # [M, V]
    return logits.index_put((rows,), masked)


def token_words(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """A bitmask row [ceil(V / 32)] int32 with the bits of `token_ids` set."""
    words = [0] * ((vocab_size + 31) // 32)
    for token in token_ids:
        words[token // 32] |= 1 << (token % 32)
    # as int32: bit 31 is the sign bit
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                        dtype=torch.int32)


class AcceptResult:
    """What accepting a token did to a request's grammar."""

    CONTINUE = "continue"
    TERMINATED = "terminated"  # the grammar is complete: the request ends with "stop"
    REJECTED = "rejected"  # the grammar does not allow the token: the request ends with an error


@dataclass(eq=False)
class GrammarJob:
    """One constraint on its way to a compiled grammar, shared by the requests that wait for it.

    stage: the sandbox trial's future, then (`compiling`) the compile's here; None until the
    tokenizer info the sandbox needs is built. Ends with `compiled` or `error`.
    """

    key: GrammarKey
    stage: Future | None = None
    compiling: bool = False
    compiled: "xgrammar.CompiledGrammar | None" = None
    error: str | None = None
    waiting: set[str] = field(default_factory=set)  # request ids


class StructuredOutputRequest:
    """One request's constraint: its compiled grammar (or the job that makes it) and matcher."""

    def __init__(self, constraint: StructuredOutputs, job: GrammarJob | None,
                 compiled: "xgrammar.CompiledGrammar | None") -> None:
        self.job = job
        self.compiled = compiled
        self.after_token_id = constraint.after_token_id
        self.active = constraint.after_token_id is None  # the mask applies from the next token
        self.matcher: xgrammar.GrammarMatcher | None = None

    def get_matcher(self) -> "xgrammar.GrammarMatcher":
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.compiled)  # rolls back any number of tokens
        return self.matcher


class StructuredOutputManager:
    """Compiles grammars for the model's tokenizer and keeps one matcher per constrained request.

    Lives in the core process; trials run in the sandbox's processes, compiles on this process's
    two compile threads, everything else on the step loop (`advance` moves the jobs on).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 config: StructuredOutputsConfig | None = None, pin_memory: bool = False) -> None:
        """
        Args:
            tokenizer: the model's Hugging Face tokenizer.
            vocab_size: the model config's vocabulary size (the logits' width).
            stop_token_ids: ids that end a grammar (the model's EOS ids).
            config: the limits, the sandbox's budgets and the cache's size.
            pin_memory: build bitmasks in pinned memory (for an asynchronous copy to a GPU).
        """
        self.vocab_size = vocab_size
        self.config = config or StructuredOutputsConfig()
        self.pin_memory = pin_memory
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._stop_words = token_words(self._stop_token_ids, vocab_size)
        # True: the quick thread (and the tokenizer info), False: the slow one
        self._threads = {quick: ThreadPoolExecutor(1, thread_name_prefix=f"grammar-compile-{name}")
                         for quick, name in ((True, "quick"), (False, "slow"))}
        self._compiler_lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._tokenizer_info_json: str | None = None  # what the sandbox's workers compile for
        self._sandbox: GrammarSandbox | None = None
        self._cache: OrderedDict[bytes, xgrammar.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._trials: OrderedDict[bytes, TrialResult] = OrderedDict()
        self._jobs: dict[bytes, GrammarJob] = {}  # by key digest, until compiled or failed
        self._requests: dict[str, StructuredOutputRequest] = {}
        self._compiling: dict[str, StructuredOutputRequest] = {}  # grammar not compiled yet
        self._failed: dict[str, str] = {}  # request id -> why its constraint failed
        self._batch_matchers: dict[int, xgrammar.BatchGrammarMatcher] = {}  # by thread count
        self.num_compiled = 0  # grammars compiled here (cache misses), for tests and stats
        self.num_trials = 0  # compiles tried in the sandbox
        # build the tokenizer info (and import xgrammar) in the background, before any request
        self._tokenizer_info = self._threads[True].submit(self._get_compiler)

    # ---- compilation (compile threads) ---------------------------------------------------
    def _get_compiler(self) -> "xgrammar.GrammarCompiler":
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS,
                                                     cache_enabled=False)
                self._tokenizer_info_json = info.serialize_json()
            return self._compiler

    def _compile(self, key: GrammarKey) -> "xgrammar.CompiledGrammar":
        try:
            return self._get_compiler().compile_grammar(parse_grammar(key))
        finally:
            trim_heap()  # the compile's transient memory goes back to the system

    # ---- requests (step loop) ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Take the cached grammar of the request's constraint, or wait for its compile (joining
        one in progress, or starting one). The constraint was validated at the door."""
        constraint = request.params.structured_outputs
        assert constraint is not None
        key = grammar_key(constraint)
        digest = key.digest
        compiled = self._cache.get(digest)
        if compiled is not None:
            self._cache.move_to_end(digest)
            self._requests[request.request_id] = StructuredOutputRequest(constraint, None,
                                                                         compiled)
            return
        job = self._jobs.get(digest)
        if job is None:
            job = self._jobs[digest] = GrammarJob(key)
            trial = self._trials.get(digest)
            if trial is not None:  # tried before; its compiled grammar left the cache since
                self._trials.move_to_end(digest)
                self._compile_here(job, trial)
        job.waiting.add(request.request_id)
        state = StructuredOutputRequest(constraint, job, None)
        self._requests[request.request_id] = self._compiling[request.request_id] = state

    def _compile_here(self, job: GrammarJob, trial: TrialResult) -> None:
        job.stage = self._threads[trial.seconds < QUICK_COMPILE_S].submit(self._compile, job.key)
        job.compiling = True

    def advance(self) -> None:
        """Move the compiles on (start trials, compile what passed, cache what compiled) and
        hand their grammars to the requests that wait; the requests whose constraint failed
        are forgotten here and reported by `take_failed`."""
        for digest, job in list(self._jobs.items()):
            if job.stage is None:
                if self._tokenizer_info.done():
                    self._start_trial(job)
                if job.error is not None:
                    del self._jobs[digest]
                continue
            if not job.stage.done():
                continue
            exc = job.stage.exception()
            if not job.compiling:  # the trial ended
                if exc is None:
                    self._remember(digest, job.stage.result())
                    self._compile_here(job, job.stage.result())
                    continue
                job.error = self._sandbox.failure_message(exc)
            elif exc is None:
                job.compiled = job.stage.result()
                self.num_compiled += 1
                self._cache_put(digest, job.compiled)
            else:
                job.error = f"the structured output grammar did not compile: {error_text(exc)}"
            del self._jobs[digest]
        for request_id, state in list(self._compiling.items()):
            if state.job.compiled is not None:
                state.compiled, state.job = state.job.compiled, None
                del self._compiling[request_id]
            elif state.job.error is not None:
                error = state.job.error
                self.remove_id(request_id)
                self._failed[request_id] = error

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, error) of the requests whose constraint failed since the last call."""
        failed, self._failed = list(self._failed.items()), {}
        return failed

    def take_failure(self, request_id: str) -> str | None:
        """The error of one request whose constraint failed (reported here, not by
        `take_failed`), or None."""
        return self._failed.pop(request_id, None)

    def _start_trial(self, job: GrammarJob) -> None:
        exc = self._tokenizer_info.exception()
        if exc is not None:
            job.error = f"structured outputs are not available: {error_text(exc)}"
            return
        if self._sandbox is None:
            self._sandbox = GrammarSandbox(self._tokenizer_info_json, self.config)
        job.stage = self._sandbox.trial(job.key)
        self.num_trials += 1

    def _remember(self, digest: bytes, trial: TrialResult) -> None:
        self._trials[digest] = trial
        while len(self._trials) > MAX_TRIAL_RESULTS:
            self._trials.popitem(last=False)

    def _cache_put(self, digest: bytes, compiled: "xgrammar.CompiledGrammar") -> None:
        """Keep a compiled grammar, least recently used ones out past cache_mb."""
        size, budget = compiled.memory_size_bytes, self.config.cache_mb * 2**20
        if size > budget:
            return
        self._cache[digest] = compiled
        self._cache_bytes += size
        while self._cache_bytes > budget:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= evicted.memory_size_bytes

    @property
    def cache_bytes(self) -> int:
        """The compiled grammars kept for reuse (xgrammar's measure)."""
        return self._cache_bytes

    def remove(self, request: Request) -> None:
        self.remove_id(request.request_id)

    def remove_id(self, request_id: str) -> None:
        """Forget a request; a compile that no request waits for any more is cancelled."""
        self._requests.pop(request_id, None)
        self._failed.pop(request_id, None)
        state = self._compiling.pop(request_id, None)
        job = state.job if state is not None else None
        if job is None or self._jobs.get(job.key.digest) is not job:
            return
        job.waiting.discard(request_id)
        if job.waiting:
            return
        # a trial is killed; a compile here is dropped unless it runs (then it lands in the
        # cache, for the client that asks again)
        if job.stage is None or job.stage.cancel() or not job.compiling:
            del self._jobs[job.key.digest]

    def waits_for_grammar(self, request: Request) -> bool:
        """Whether the request may not run yet: its grammar is not compiled (`advance` hands
        it over, or fails it). The scheduler skips such a request."""
        return self.is_compiling(request.request_id)

    def is_compiling(self, request_id: str) -> bool:
        return request_id in self._compiling

    @property
    def has_compiling(self) -> bool:
        return bool(self._compiling)

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until some compile that a request waits for moves on, at most `timeout` s."""
        waiting = [job.stage or self._tokenizer_info for job in self._jobs.values()]
        waiting = [future for future in waiting if not future.done()]
        if waiting:
            concurrent.futures.wait(waiting, timeout, concurrent.futures.FIRST_COMPLETED)

    def grammar_bitmask(self, requests: list[Request]) -> GrammarBitmask | None:
        """The bitmask of the requests whose next token is constrained, or None if none is.

        Every token of these requests must be known (accepted) on the host. A request verifying
        d drafts (speculative decoding) gets d + 1 consecutive rows from `row_of`: the mask of
        each position after the drafts before it. Past a draft the grammar refuses, the rows
        repeat the last mask (the verification rejects that draft, so no later position is
        sampled).
        """
        constrained = []
        for request in requests:
            state = self._requests.get(request.request_id)
            if state is not None and state.active:
                constrained.append((request, state.get_matcher()))
        if not constrained:
            return None
        import xgrammar as xgr

        drafts = [r.draft_token_ids[:r.num_scheduled_drafts] for r, _ in constrained]
        if any(drafts):
            return self._draft_bitmask(constrained, drafts)
        shape = xgr.get_bitmask_shape(len(constrained), self.vocab_size)
        bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin_memory)
        matchers = [m for _, m in constrained]
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            threads = max(1, min(len(matchers) // MIN_ROWS_PER_FILL_THREAD,
                                 (os.cpu_count() or 1) // 2, 8))
            batch_matcher = self._batch_matchers.get(threads)
            if batch_matcher is None:
                batch_matcher = self._batch_matchers[threads] = xgr.BatchGrammarMatcher(threads)
            batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
        return self._with_must_end([r for r, _ in constrained], range(len(constrained)),
                                   bitmask)

    def _with_must_end(self, requests: list[Request], rows: Sequence[int],
                       bitmask: torch.Tensor) -> GrammarBitmask:
        """The `GrammarBitmask` of requests whose next-position masks are these rows, with
        `must_end` read from those rows."""
        must_end = {request.request_id for request, row in zip(requests, rows, strict=True)
                    if request.num_output_tokens_total < request.params.min_tokens
                    and not bool((bitmask[row] & ~self._stop_words).any())}
        return GrammarBitmask({r.request_id: row for r, row in zip(requests, rows, strict=True)},
                              bitmask, must_end)

    def _draft_bitmask(self, constrained: list[tuple[Request, "xgrammar.GrammarMatcher"]],
                       drafts: list[list[int]]) -> GrammarBitmask:
        """`grammar_bitmask` for a step in which some constrained requests verify drafts: each
        matcher walks its drafts, filling a row per position, and rolls back."""
        import xgrammar as xgr

        firsts = [0]
        for draft in drafts:
            firsts.append(firsts[-1] + len(draft) + 1)
        shape = xgr.get_bitmask_shape(firsts[-1], self.vocab_size)
        bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin_memory)
        for (_, matcher), draft, first in zip(constrained, drafts, firsts[:-1], strict=True):
            matcher.fill_next_token_bitmask(bitmask, first)
            walked = 0  # drafts the matcher took; past a refused one it takes no more
            for i, token in enumerate(draft, 1):
                if walked == i - 1 and not matcher.is_terminated() \
                        and matcher.accept_token(token):
                    walked = i
                    matcher.fill_next_token_bitmask(bitmask, first + i)
                else:  # refused: later positions are never sampled
                    bitmask[first + i] = bitmask[first + i - 1]
            if walked:
                matcher.rollback(walked)
        return self._with_must_end([r for r, _ in constrained], firsts[:-1], bitmask)

    def accept_token(self, request: Request, token: int) -> str:
        """Advance the request's matcher by a generated token (an `AcceptResult` value)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return AcceptResult.CONTINUE
        if not state.active:
            state.active = token == state.after_token_id
            return AcceptResult.CONTINUE
        matcher = state.get_matcher()
        if not matcher.accept_token(token):
            return AcceptResult.REJECTED
        return AcceptResult.TERMINATED if matcher.is_terminated() else AcceptResult.CONTINUE

    def shutdown(self) -> None:
        for pool in self._threads.values():
            pool.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.shutdown()
            self._sandbox = None
