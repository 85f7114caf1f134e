"""AsyncEngine: the LLMEngine's step loop on its own thread, streams to asyncio consumers.

The engine's state is touched only by the loop thread. Callers validate and tokenize in their own
thread (`LLMEngine.make_request`), then hand requests and aborts to the loop through a queue;
outputs come back to each request's asyncio queue with `call_soon_threadsafe`.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mlaserve.engine.engine import EngineArgs, LLMEngine, StepFailed
from mlaserve.engine.request import Request, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine step that carried this request failed; the request was aborted."""


@dataclass
class EngineStats:
    """Counters and gauges for /metrics, updated by the loop thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    iteration_tokens: list[int] = field(default_factory=list)


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream_queue, output in items:
        stream_queue.put_nowait(output)


class AsyncEngine:
    """add_request(...) -> async iterator of RequestOutput; abort(request_id)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="mlaserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, args: EngineArgs, warm_up: bool = False) -> "AsyncEngine":
        """Build the engine; `warm_up` runs one short request first (see LLMEngine.warm_up)."""
        engine = LLMEngine(args)
        if warm_up:
            engine.warm_up()
        return cls(engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate (ValueError here, before anything is queued) and stream the outputs."""
        request = self.engine.make_request(prompt, params, request_id)
        stream = _Stream(asyncio.get_running_loop())
        self._inbox.put(("add", request, stream))
        self._wakeup.set()
        return self._iterate(request.request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect, cancellation)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wakeup.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the loop thread."""
        self._inbox.put(("shutdown", None, None))
        self._wakeup.set()
        self._thread.join(timeout)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item, stream = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(item, stream)
            elif kind == "abort":
                self._abort(item)
            else:
                self._stopping = True

    def _add(self, request: Request, stream: _Stream) -> None:
        try:
            self.engine.submit(request)
        except ValueError as exc:
            stream.put(exc)
            return
        self._streams[request.request_id] = stream

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if output is not None and stream is not None:
            stream.put(output)
        self.engine.release(request_id)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one wake-up per event loop, not one per output."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, output))
            self._settle(output)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _settle(self, output: RequestOutput) -> None:
        if output.finished:
            self._streams.pop(output.request_id, None)
            self.engine.release(output.request_id)
            self.stats.finished[output.finish_reason] = (
                self.stats.finished.get(output.finish_reason, 0) + 1)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            self._drain_inbox()
            if self._stopping:
                for request_id in list(self._streams):
                    self._abort(request_id)
                return
            if not engine.has_unfinished:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            started = time.perf_counter()
            try:
                outputs = engine.step()
            except StepFailed as exc:
                logger.exception("engine step failed; aborting its %d request(s)",
                                 len(exc.request_ids))
                for request_id in exc.request_ids:
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.put(EngineError(str(exc.cause)))
                    engine.release(request_id)
                continue
            self._deliver_all(outputs)
            self._update_stats(outputs, time.perf_counter() - started)

    def _update_stats(self, outputs: list[RequestOutput], seconds: float) -> None:
        scheduler, pool = self.engine.scheduler, self.engine.pool
        s = self.stats
        s.num_running, s.num_waiting = len(scheduler.running), len(scheduler.waiting)
        s.kv_usage = pool.usage
        s.num_preemptions = scheduler.num_preemptions
        s.prefix_queries, s.prefix_hits = pool.num_queries, pool.num_hits
        s.generation_tokens += len(outputs)
        s.prompt_tokens += sum(len(o.prompt_token_ids) for o in outputs if len(o.token_ids) == 1)
