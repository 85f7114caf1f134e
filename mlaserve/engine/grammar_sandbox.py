"""The grammar sandbox: a constraint's first compile runs in a worker process, bounded in time
and memory, before the engine compiles it in its own.

Why: xgrammar parses and compiles in C++ calls that no deadline can interrupt, and their time
and memory depend on what a client wrote (a schema nested hundreds deep parses for seconds, a
grammar of 100,000 rules allocates until the kernel kills the process). In a worker process
both are bounded: the worker may allocate `compile_memory_mb` beyond its size after start-up
(sandbox_process.py), so an allocation past it fails inside xgrammar (std::bad_alloc, reported
as MemoryError), and pebble's process pool kills a trial that runs past `compile_timeout_s`,
or whose requests are all gone (`Future.cancel`), and starts a new worker. A trial that ends
says how long the compile took (`TrialResult`); the engine then compiles the same grammar in
its own process, where that compile is known to end in about that time and within the cap.

The compiled grammar itself does not cross the process boundary: its serialized form can be
hundreds of times its size (a schema of 1,000 optional properties: 4 MB compiled, 630 MB
serialized), so compiling twice is the cheaper way. Constraints seen before skip the trial
(structured.py keeps their results).

Lanes: constraints of at most `SMALL_CONSTRAINT_BYTES` go to a worker of their own, so a small
one never waits behind a large one. A worker that hit its memory cap is replaced before its lane
takes the next trial. Workers are spawned (the engine process has threads) when the first
constraint of their lane arrives. They run at the engine's priority: on a 2-core machine with
greedy streams running, tests/test_server_hostile_inputs.py's heavy constraint was answered in
0.3 s, and in 18-19 s when its worker ran at nice 5.
"""

import multiprocessing
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import NamedTuple

from mlaserve.engine.grammars import GrammarKey, error_text, parse_grammar
from mlaserve.engine.structured_config import StructuredOutputsConfig
from mlaserve.sandbox_process import enter_sandbox, trim_heap

SMALL_CONSTRAINT_BYTES = 16 * 2**10
# xgrammar's threads per compile, here and in the engine: a quarter of the cores, 1 to 4 (more
# would take the cores that the engine's steps run on)
COMPILE_THREADS = min(4, max(1, (os.cpu_count() or 1) // 4))


class TrialResult(NamedTuple):
    """What a sandboxed compile measured."""

    seconds: float  # parse + compile, wall clock
    memory_bytes: int  # the compiled grammar's size (xgrammar's memory_size_bytes)


class GrammarSandbox:
    """Trial compiles in two lanes of one worker process each (small and large constraints).

    `trial(key)` returns a concurrent Future of a TrialResult, or of the exception that
    `failure_message` turns into what the request's client is told.
    """

    def __init__(self, tokenizer_info_json: str, config: StructuredOutputsConfig) -> None:
        """tokenizer_info_json: the engine's xgrammar TokenizerInfo, serialized (each worker
        compiles against the same vocabulary)."""
        self._config = config
        self._initargs = (tokenizer_info_json, config.compile_memory_mb * 2**20, COMPILE_THREADS)
        self._lanes: dict[bool, object] = {}  # small? -> pebble.ProcessPool, made on first use
        self._worn: set[bool] = set()  # lanes whose worker hit its memory cap

    def trial(self, key: GrammarKey) -> Future:
        """Start the trial compile of `key` (Future[TrialResult]); cancel the future to kill
        it."""
        small = len(key.spec) <= SMALL_CONSTRAINT_BYTES
        pool = self._lanes.get(small)
        if pool is not None and small in self._worn:
            # a worker whose allocations failed may hold half-freed memory: a fresh one
            self._worn.discard(small)
            threading.Thread(target=_stop, args=(pool,), daemon=True).start()
            pool = None
        if pool is None:
            import pebble

            pool = self._lanes[small] = pebble.ProcessPool(
                max_workers=1, initializer=_start_worker, initargs=self._initargs,
                context=multiprocessing.get_context("spawn"))
        future = pool.schedule(_trial, args=(key,), timeout=self._config.compile_timeout_s)
        future.add_done_callback(lambda done: self._note_memory_error(done, small))
        return future

    def _note_memory_error(self, future: Future, lane: bool) -> None:
        if not future.cancelled() and isinstance(future.exception(), MemoryError):
            self._worn.add(lane)

    def failure_message(self, exc: BaseException) -> str:
        """Why a trial failed, as the request's client is told (naming the limit to change)."""
        import pebble

        config = self._config
        if isinstance(exc, (FutureTimeoutError, TimeoutError)):
            return (f"the structured output grammar did not compile within "
                    f"{config.compile_timeout_s:g} s (--structured-outputs-config."
                    "compile_timeout_s); simplify the constraint")
        if isinstance(exc, MemoryError):
            return (f"the structured output grammar needs more than {config.compile_memory_mb} "
                    "MiB to compile (--structured-outputs-config.compile_memory_mb); simplify "
                    "the constraint")
        if isinstance(exc, pebble.ProcessExpired):
            return (f"compiling the structured output grammar ended its process "
                    f"({exc}); simplify the constraint")
        if isinstance(exc, ValueError):  # the parse's own message names the field
            return str(exc)
        return f"the structured output grammar did not compile: {error_text(exc)}"

    def shutdown(self) -> None:
        """Stop the workers (a trial in progress is killed)."""
        for pool in self._lanes.values():
            pool.stop()
        for pool in self._lanes.values():
            pool.join(timeout=5)
        self._lanes.clear()


def _stop(pool) -> None:
    pool.stop()
    pool.join(timeout=5)


# ---- the worker process ---------------------------------------------------------------------
_compiler = None  # the worker's xgrammar GrammarCompiler


def _start_worker(tokenizer_info_json: str, memory_bytes: int, threads: int) -> None:
    """pebble's initializer: the compiler, then the memory cap (`enter_sandbox`)."""
    global _compiler
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    _compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    enter_sandbox(memory_bytes)


def _trial(key: GrammarKey) -> TrialResult:
    """Parse and compile `key` (ValueError for an invalid constraint, MemoryError past the
    cap)."""
    start = time.perf_counter()
    try:
        compiled = _compiler.compile_grammar(parse_grammar(key))
        return TrialResult(time.perf_counter() - start, compiled.memory_size_bytes)
    except (ValueError, RuntimeError) as exc:
        if "bad_alloc" in str(exc):
            raise MemoryError(str(exc)) from None
        if isinstance(exc, ValueError):
            raise
        raise ValueError("the structured output grammar did not compile: "
                         f"{error_text(exc)}") from None
    finally:
        compiled = None
        trim_heap()
