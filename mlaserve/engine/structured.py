"""Structured outputs: grammar-constrained sampling with xgrammar.

A request's `SamplingParams.structured_outputs` (request.py) names a constraint: a JSON schema, any
JSON object, a regex, a choice of strings or an EBNF grammar. Its life:

- At the door (`validate_structured_outputs`, called by `messages.validate_prompt` in the API
  process, in `LLMEngine` and again in the core): the constraint is parsed into an xgrammar
  `Grammar`, which needs no tokenizer, so a bad schema, regex or grammar is a ValueError that
  says what is wrong before anything is queued. Parses are cached by constraint.
- In the core (`StructuredOutputManager`): the grammar is compiled against the model's tokenizer
  (`xgrammar.TokenizerInfo` with the model config's vocab_size, which may exceed the tokenizer's
  length; ids past the tokenizer are never allowed) on a thread pool, off the step loop. Compiled
  grammars are cached by constraint, so the same constraint compiles once. While its grammar
  compiles, a request waits in the scheduler's queue without holding up the requests behind it
  (the scheduler skips it; vLLM's WAITING_FOR_FSM).
- Each step (`StructuredOutputManager.grammar_bitmask`): one matcher per request fills, on the
  host, a token bitmask for the constrained rows that sample; the batched sampler applies it on
  the device (`apply_token_bitmask`) before greedy argmax, the Gumbel pass and the top-k/p path
  alike. Unconstrained rows are untouched.
- When a step's tokens land (`accept_token`), each constrained request's matcher advances by its
  token. A grammar that has terminated (it accepted a stop token at its end) ends the request
  with finish_reason "stop", as in vLLM. A token the grammar rejects (possible only when nothing
  was allowed, e.g. min_tokens bans the only token left, EOS) ends the request with an error.

`after_token_id`: the request samples freely until it generates that token (e.g. `</think>`);
the mask starts with the next token. Pipelining: a constrained request's next bitmask needs its
previous token accepted, so a step carrying one is collected before the next is launched (as for
penalties; see core.py `_needs_known_tokens`).
"""

import concurrent.futures
import functools
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mlaserve.engine.request import Request, StructuredOutputs

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str, bool]  # (kind, spec, any_whitespace): a constraint's cache key
MAX_CACHED_GRAMMARS = 512
# bitmasks of fewer rows are filled on one thread: a thread pool's hand-off costs more than it
# saves there, and on a CPU device its threads contend with torch's
MIN_ROWS_PER_FILL_THREAD = 64
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "
_CPP_ERROR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
_OBJECT_SCHEMA = '{"type": "object"}'


def grammar_key(constraint: StructuredOutputs) -> GrammarKey:
    """The constraint as a hashable (kind, spec, any_whitespace) triple; `after_token_id` is
    not part of it (any_whitespace matters for JSON only and is True for the other kinds)."""
    any_whitespace = not constraint.disable_any_whitespace
    if constraint.json is not None:
        return "json", constraint.json, any_whitespace
    if constraint.json_object:
        # vLLM's json_object: a schema of any object
        return "json", _OBJECT_SCHEMA, any_whitespace
    if constraint.regex is not None:
        return "regex", constraint.regex, True
    if constraint.choice is not None:
        return "choice", json.dumps(constraint.choice), True
    return "grammar", constraint.grammar or "", True


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return _CPP_ERROR_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)


_FIELD_OF_KIND = {"json": "json (a JSON schema)", "regex": "regex", "choice": "choice",
                  "grammar": "grammar (EBNF)"}


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def parse_grammar(kind: str, spec: str, any_whitespace: bool = True) -> "xgrammar.Grammar":
    """The xgrammar Grammar of a `grammar_key`; ValueError naming the field and the fault."""
    import xgrammar as xgr

    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            # JSON string literals are EBNF string literals (same escapes)
            choices = json.loads(spec)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.{_FIELD_OF_KIND[kind]} is invalid: "
                         f"{_error_text(exc)}") from None


def validate_structured_outputs(constraint: StructuredOutputs, vocab_size: int) -> None:
    """ValueError, saying what is wrong, unless the constraint can be compiled for this model."""
    constraint.validate()
    if constraint.after_token_id is not None and constraint.after_token_id >= vocab_size:
        raise ValueError(f"structured_outputs.after_token_id must be a token id in [0, "
                         f"{vocab_size}) (the model's vocabulary), got {constraint.after_token_id}")
    parse_grammar(*grammar_key(constraint))


@dataclass
class GrammarBitmask:
    """One step's token masks for its constrained sampling rows, built on the host.

    row_of: id(request) -> its row in `bitmask`, for the requests whose next token is
    constrained. bitmask: [M, ceil(V / 32)] int32; bit j of word w allows token 32 * w + j.
    """

    row_of: dict[int, int]
    bitmask: torch.Tensor


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


class AcceptResult:
    """What accepting a token did to a request's grammar."""

    CONTINUE = "continue"
    TERMINATED = "terminated"  # the grammar is complete: the request ends with "stop"
    REJECTED = "rejected"  # the grammar does not allow the token: the request ends with an error


class StructuredOutputRequest:
    """One request's constraint: its grammar (a future while it compiles) and its matcher."""

    def __init__(self, constraint: StructuredOutputs, grammar: Future) -> None:
        self.grammar = grammar  # Future[xgrammar.CompiledGrammar]
        self.after_token_id = constraint.after_token_id
        self.active = constraint.after_token_id is None  # the mask applies from the next token
        self.matcher: xgrammar.GrammarMatcher | None = None

    @property
    def is_ready(self) -> bool:
        """Compiled (a failed compile is never ready: the core fails the request)."""
        return self.grammar.done() and self.grammar.exception() is None

    def get_matcher(self) -> "xgrammar.GrammarMatcher":
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.grammar.result())
        return self.matcher


class StructuredOutputManager:
    """Compiles grammars for the model's tokenizer and keeps one matcher per constrained request.

    Lives in the core process; compilation runs on a thread pool (xgrammar compiles in C++
    without the GIL), everything else on the step loop.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_workers: int = 1, pin_memory: bool = False) -> None:
        """
        Args:
            tokenizer: the model's Hugging Face tokenizer.
            vocab_size: the model config's vocabulary size (the logits' width).
            stop_token_ids: ids that end a grammar (the model's EOS ids).
            pin_memory: build bitmasks in pinned memory (for an asynchronous copy to a GPU).
        """
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._compiler_lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._grammars: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._requests: dict[str, StructuredOutputRequest] = {}
        self._compiling: dict[str, StructuredOutputRequest] = {}  # grammar not compiled yet
        self._batch_matchers: dict[int, xgrammar.BatchGrammarMatcher] = {}  # by thread count
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and stats
        # build the tokenizer info (and import xgrammar) in the background, before any request
        self._executor.submit(self._get_compiler)

    # ---- compilation (pool threads) ------------------------------------------------------
    def _get_compiler(self) -> "xgrammar.GrammarCompiler":
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)
            return self._compiler

    def _compile(self, key: GrammarKey) -> "xgrammar.CompiledGrammar":
        compiled = self._get_compiler().compile_grammar(parse_grammar(*key))
        self.num_compiled += 1
        return compiled

    # ---- requests (step loop) ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (or reuse the cached one).

        ValueError if the constraint does not parse (`validate_structured_outputs`).
        """
        constraint = request.params.structured_outputs
        assert constraint is not None
        validate_structured_outputs(constraint, self.vocab_size)
        key = grammar_key(constraint)
        future = self._grammars.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._executor.submit(self._compile, key)
            self._grammars[key] = future
            self._evict()
        else:
            self._grammars.move_to_end(key)
        state = StructuredOutputRequest(constraint, future)
        self._requests[request.request_id] = state
        if not state.is_ready:
            self._compiling[request.request_id] = state

    def _evict(self) -> None:
        while len(self._grammars) > MAX_CACHED_GRAMMARS:
            key = next(iter(self._grammars))
            self._grammars.pop(key)  # a request still compiling keeps its own future

    def remove(self, request: Request) -> None:
        self.remove_id(request.request_id)

    def waits_for_grammar(self, request: Request) -> bool:
        """Whether the request may not run yet: its grammar is compiling (or failed to, until
        `take_failed` reports it). The scheduler skips such a request."""
        state = self._compiling.get(request.request_id)
        if state is None:
            return False
        if state.is_ready:
            del self._compiling[request.request_id]
            return False
        return True

    @property
    def has_compiling(self) -> bool:
        return bool(self._compiling)

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until some grammar that a request waits for is compiled, at most `timeout` s."""
        waiting = [s.grammar for s in self._compiling.values() if not s.grammar.done()]
        if waiting:
            concurrent.futures.wait(waiting, timeout, concurrent.futures.FIRST_COMPLETED)

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, error) of requests whose grammar failed to compile; forgotten here."""
        failed = []
        for request_id, state in list(self._compiling.items()):
            if state.grammar.done() and state.grammar.exception() is not None:
                failed.append((request_id, "the structured output grammar did not compile: "
                                           f"{_error_text(state.grammar.exception())}"))
                self.remove_id(request_id)
        return failed

    def remove_id(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._compiling.pop(request_id, None)

    def grammar_bitmask(self, requests: list[Request]) -> GrammarBitmask | None:
        """The bitmask of the requests whose next token is constrained, or None if none is.

        Every token of these requests must be known (accepted) on the host.
        """
        constrained = []
        for request in requests:
            state = self._requests.get(request.request_id)
            if state is not None and state.active:
                constrained.append((request, state.get_matcher()))
        if not constrained:
            return None
        import xgrammar as xgr

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
        return GrammarBitmask({id(r): i for i, (r, _) in enumerate(constrained)}, bitmask)

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
        self._executor.shutdown(wait=False, cancel_futures=True)
