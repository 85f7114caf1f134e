"""AsyncEngineClient: the API server's handle on the engine-core process (core_process.py).

Design. `start()` spawns the core process, connects to it over two ZeroMQ ipc:// sockets in a
temporary directory and loads the tokenizer while the core loads the model. Requests are
validated here (a ValueError before anything is queued), then sent as `EngineCoreRequest`s. One
asyncio task receives each step's message, turns its token deltas into `RequestOutput`s with a
single `OutputProcessor` (detokenization and stop strings live in this process), sends the
requests that a stop string finished back to the core as aborts, and puts each output on its
request's asyncio queue. Leaving a stream before its end (a client disconnect) aborts the request
in the core, which frees its blocks. With `output_kind="delta"` each output carries only what is
new, so a token costs the same at any length. The process's exit is watched through its sentinel
on the event loop: if it dies, every request in flight fails with `EngineDeadError` and `on_dead`
is called (the server stops). Sends never block: the input socket connects (it queues), and the
core never waits for this process. pyzmq and msgspec are used rather than pipes and pickle:
ZeroMQ gives framing, queueing and asyncio integration, and msgspec typed msgpack decoding is
fast and checks the schema.

Data parallelism (`data_parallel_size` N): N core processes (core_launch.py), one receiver task
each; a new request goes to the replica with the fewest requests in flight, its aborts follow
it, stats are the replicas' combined, and any core's death is the engine's. Under expert
parallelism this process opens the store where the cores' world meets, and wakes every core
when one gets a request (they step together: data_parallel.py).
"""

import asyncio
import importlib
import logging
import multiprocessing
import random
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from mlaserve.distributed.launch import create_store
from mlaserve.engine.args import EngineArgs, model_dir_of
from mlaserve.engine.core_launch import (
    CoreProcess,
    close_cores,
    describe_exit,
    spawn_core,
    wait_ready,
)
from mlaserve.engine.core_process import (
    AbortRequests,
    AddRequest,
    CoreMessage,
    Failed,
    GetStats,
    Shutdown,
    Stats,
    StepOutputs,
    Wake,
)
from mlaserve.engine.data_parallel import LoadBalancer, combine_stats
from mlaserve.engine.engine_config import parallel_layout
from mlaserve.engine.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
    SchedulerStats,
    validate_prompt,
)
from mlaserve.engine.output_processor import OutputProcessor
from mlaserve.engine.request import RequestOutput, SamplingParams
from mlaserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
STORE_TIMEOUT = timedelta(seconds=300)


class EngineError(RuntimeError):
    """A step that carried this request alone failed; the request was aborted (the others in its
    step went on)."""


class EngineDeadError(EngineError):
    """The engine process is gone: requests in flight fail with this and no new one is taken."""


class RequestRejected(EngineError):
    """The core refused the request itself (e.g. a structured-output constraint that does not
    compile within the server's limits): a client error, with a message saying what to
    change."""


@dataclass
class FinishedRequestStats:
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    first_token_latency: float | None  # seconds from arrival; None when no token came
    e2e_latency: float
    # vLLM's request phases: waiting in the core's queue (measured there), then from the first
    # step that computed it to its first token (prefill), to its last (inference); decode is
    # first to last token. None where the request never got that far.
    queued_time: float | None = None
    prefill_time: float | None = None
    inference_time: float | None = None
    decode_time: float | None = None
    max_tokens_param: int | None = None


@dataclass
class IterationStats:
    """What one message from the core (or an abort) added, for /metrics."""

    num_prompt_tokens: int = 0  # prompts of the requests whose first token came
    num_generation_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatsRecorder(Protocol):
    def record(self, stats: IterationStats) -> None: ...


class OutputCollector:
    """The outputs of one request that its consumer has not taken yet.

    Delta outputs that pile up (the consumer, e.g. an HTTP stream, is slower than the engine)
    merge into one, so a lagging stream catches up with fewer, larger chunks instead of falling
    further behind; a cumulative output replaces the one before it. An exception replaces
    whatever is pending: the request failed.
    """

    def __init__(self) -> None:
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        if (isinstance(item, RequestOutput) and isinstance(pending, RequestOutput)
                and item.output_kind == "delta"):
            item = merge_deltas(pending, item)
        self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while self._pending is None:
            await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        return item


def merge_deltas(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """One delta output holding what two consecutive ones hold."""
    logprobs = None if first.logprobs is None else first.logprobs + second.logprobs
    return replace(
        second, text=first.text + second.text, token_ids=first.token_ids + second.token_ids,
        logprobs=logprobs, prompt_logprobs=first.prompt_logprobs or second.prompt_logprobs)


@dataclass(eq=False)
class _Stream:
    """A request in flight: its pending outputs and its timing."""

    queue: OutputCollector
    num_prompt_tokens: int
    arrival: float
    max_tokens: int
    replica: int  # the engine core (data-parallel replica) serving it
    first_token: float | None = None
    last_token: float = 0.0
    num_generation_tokens: int = 0
    queued_time: float | None = None  # the core's, with the first output

    def finished(self, reason: str, now: float) -> FinishedRequestStats:
        """The request's stats; the phases after the queue are measured here, from arrival in
        this process minus the core's queue time (so they include the hop to the core)."""
        stats = FinishedRequestStats(reason, self.num_prompt_tokens, self.num_generation_tokens,
                                     None, now - self.arrival, max_tokens_param=self.max_tokens)
        if self.first_token is None:
            return stats
        stats.first_token_latency = self.first_token - self.arrival
        stats.decode_time = self.last_token - self.first_token
        if self.queued_time is not None:
            stats.queued_time = self.queued_time
            stats.prefill_time = max(0.0, stats.first_token_latency - self.queued_time)
            stats.inference_time = max(0.0, self.last_token - self.arrival - self.queued_time)
        return stats


class AsyncEngineClient:
    """add_request(...) -> async iterator of RequestOutput; abort(request_id); shutdown().

    Build it with `await AsyncEngineClient.start(args)`; use it from that event loop only.
    With `data_parallel_size` N it drives N engine cores, one per replica, and gives each new
    request to the least loaded (data_parallel.py); everything else is the same.
    """

    def __init__(self, cores: list[CoreProcess], socket_dir: str, context: zmq.Context,
                 info: EngineInfo, tokenizer, seed: int, stats_recorder: StatsRecorder | None,
                 on_dead: Callable[[EngineDeadError], None] | None, lockstep: bool = False,
                 store=None) -> None:
        self.cores = cores
        self.info = info
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        self.loop = asyncio.get_running_loop()
        self._socket_dir = socket_dir
        self._context = context
        self._lockstep = lockstep  # the cores step together: a request wakes them all
        self._store = store  # the world's store under expert parallelism, kept open
        self._balancer = LoadBalancer(len(cores))
        self._encoder = msgspec.msgpack.Encoder()
        self._stats_recorder = stats_recorder
        self._on_dead = on_dead
        self._seed_rng = random.Random(seed)
        self._streams: dict[str, _Stream] = {}
        self._dead: EngineDeadError | None = None
        self._closing = False
        for core in cores:
            self.loop.add_reader(core.process.sentinel, self._on_process_exit, core)
        self._receivers = [asyncio.create_task(self._receive(core)) for core in cores]

    @property
    def processes(self) -> list[multiprocessing.Process]:
        """The engine-core processes, one per replica."""
        return [core.process for core in self.cores]

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The cores' stats, as of their latest messages."""
        return combine_stats([core.stats for core in self.cores])

    @classmethod
    async def start(cls, args: EngineArgs, stats_recorder: StatsRecorder | None = None,
                    on_dead: Callable[[EngineDeadError], None] | None = None
                    ) -> "AsyncEngineClient":
        """Start the core process(es) and wait until each has loaded and warmed up the model.

        Raises EngineLoadError naming the cause when the model cannot be loaded.
        """
        loop = asyncio.get_running_loop()
        layout = parallel_layout(args)
        socket_dir = tempfile.mkdtemp(prefix="mlaserve-")
        context = zmq.Context()
        store = None
        if layout.expert_parallel:  # one world: the cores and their workers meet at this store
            store = create_store(layout.world_size, STORE_TIMEOUT)
        cores: list[CoreProcess] = []
        try:
            for replica in range(layout.data_parallel_size):
                cores.append(spawn_core(args, replica, socket_dir, context,
                                         store.port if store is not None else None))
            tokenizer = await loop.run_in_executor(
                None, load_tokenizer, args.tokenizer or model_dir_of(args))
            # the grammar library checks structured-output requests here: import it now, off
            # the event loop, rather than on the first such request
            await loop.run_in_executor(None, importlib.import_module, "xgrammar")
            infos = await wait_ready(cores)
            info = min(infos, key=lambda i: i.kv_capacity_tokens)  # a prompt fits any replica
            return cls(cores, socket_dir, context, info, tokenizer, args.seed, stats_recorder,
                       on_dead, lockstep=layout.expert_parallel, store=store)
        except BaseException:
            for core in cores:
                if core.process.is_alive():
                    core.process.kill()
            for core in cores:
                if core.process.pid is not None:
                    core.process.join()
            close_cores(context, socket_dir, cores)
            raise

    # ---- requests ------------------------------------------------------------------------
    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                          request_id: str, prompt_text: str | None = None
                          ) -> AsyncIterator[RequestOutput]:
        """Validate (ValueError here, before anything is queued) and stream the outputs.

        The stream raises EngineError if a step that carried the request alone failed, and
        EngineDeadError if the engine process died.
        """
        if self._dead is not None:
            raise self._dead
        if params.structured_outputs is None:
            validate_prompt(prompt_token_ids, params, self.info)
        else:  # checking a constraint's limits reads all its text: off the event loop
            await self.loop.run_in_executor(None, validate_prompt, prompt_token_ids, params,
                                            self.info)
            if self._dead is not None:
                raise self._dead
        self.output_processor.add_request(request_id, prompt_text, prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        replica = self._balancer.choose()
        stream = _Stream(OutputCollector(), len(prompt_token_ids), time.perf_counter(),
                         params.max_tokens, replica)
        self._streams[request_id] = stream
        self._send(replica, AddRequest(EngineCoreRequest(request_id, prompt_token_ids, params,
                                                         seed)))
        if self._lockstep:
            for core in self.cores:
                if core.replica != replica:
                    self._send(core.replica, Wake())
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort(request_id)  # a no-op once finished; else the consumer went away

    def abort(self, request_id: str) -> None:
        """Finish a request in flight as aborted and free what it holds in the core."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._balancer.release(stream.replica)
        output = self.output_processor.abort(request_id)
        if output is not None:
            stream.queue.put_nowait(output)
        self._send(stream.replica, AbortRequests([request_id]))
        if self._stats_recorder is not None:
            self._stats_recorder.record(IterationStats(
                finished=[stream.finished("abort", time.perf_counter())]))

    async def get_stats(self) -> SchedulerStats:
        """Ask the cores for their stats, as of after every message sent before this call."""
        if self._dead is not None:
            raise self._dead
        waiters = []
        for core in self.cores:
            waiters.append(self.loop.create_future())
            core.stats_waiters.append(waiters[-1])
            self._send(core.replica, GetStats())
        return combine_stats(list(await asyncio.gather(*waiters)))

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _send(self, replica: int,
              message: AddRequest | AbortRequests | GetStats | Shutdown | Wake) -> None:
        if self._dead is None:
            self.cores[replica].input.send(self._encoder.encode(message), copy=False)

    # ---- outputs -------------------------------------------------------------------------
    async def _receive(self, core: CoreProcess) -> None:
        decoder = msgspec.msgpack.Decoder(CoreMessage)
        try:
            while True:
                message = decoder.decode((await core.output.recv(copy=False)).buffer)
                if isinstance(message, StepOutputs):
                    core.stats = message.stats
                    if message.outputs:
                        self._deliver(core.replica, message.outputs)
                elif isinstance(message, Stats):
                    core.stats = message.stats
                    waiter = core.stats_waiters.popleft()
                    if not waiter.done():  # its caller may have given up waiting
                        waiter.set_result(message.stats)
                elif isinstance(message, Failed):
                    core.fatal = message.error
        except Exception as exc:  # noqa: BLE001 - without outputs the engine is of no use
            logger.exception("handling the engine's outputs failed")
            self._die(EngineDeadError(f"handling the engine's outputs failed: {exc}"))

    def _deliver(self, replica: int, core_outputs: list[EngineCoreOutput]) -> None:
        """Count and time the step's tokens, then hand each output to its request's stream."""
        now = time.perf_counter()
        streams = self._streams
        stats = IterationStats()
        for core in core_outputs:
            stream = streams.get(core.request_id)
            num_new = len(core.new_token_ids)
            if stream is None or not num_new:
                continue
            if core.queued_time is not None:
                stream.queued_time = core.queued_time
            stats.num_generation_tokens += num_new
            if stream.first_token is None:
                stream.first_token = now
                stats.num_prompt_tokens += stream.num_prompt_tokens
            else:
                stats.inter_token_latencies.append(now - stream.last_token)
            stream.last_token = now
            stream.num_generation_tokens += num_new
        processed = self.output_processor.process(core_outputs)
        if processed.abort_in_core:
            self._send(replica, AbortRequests(processed.abort_in_core))
        errors = processed.errors
        for output in processed.outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del streams[output.request_id]
                self._balancer.release(stream.replica)
                stats.finished.append(stream.finished(output.finish_reason, now))
            error = errors.get(output.request_id)
            if error is not None:
                failure = RequestRejected if output.request_id in processed.rejected \
                    else EngineError
                stream.queue.put_nowait(failure(error))
            else:
                stream.queue.put_nowait(output)
        if self._stats_recorder is not None:
            self._stats_recorder.record(stats)

    # ---- the processes -------------------------------------------------------------------
    def _on_process_exit(self, core: CoreProcess) -> None:
        self.loop.remove_reader(core.process.sentinel)
        if self._closing:
            return
        core.process.join(1)
        reason = f"{core.name} exited with {describe_exit(core.process.exitcode)}"
        if core.fatal is not None:
            reason += f": {core.fatal}"
        logger.error("%s; failing %d request(s) in flight", reason, len(self._streams))
        self._die(EngineDeadError(reason))

    def _die(self, error: EngineDeadError) -> None:
        """The engine is unusable: fail everything in flight and tell the owner."""
        if self._dead is None:
            self._fail_all(error)
            if self._on_dead is not None:
                self._on_dead(error)

    def _fail_all(self, error: EngineDeadError) -> None:
        """Fail every request in flight with `error` and refuse new ones from now on."""
        self._dead = error
        for receiver in self._receivers:
            receiver.cancel()
        for request_id, stream in self._streams.items():
            self.output_processor.abort(request_id)
            stream.queue.put_nowait(error)
        self._streams.clear()
        for core in self.cores:
            while core.stats_waiters:
                waiter = core.stats_waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(error)

    async def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the core process(es) (killed after `timeout` seconds); what is in flight
        fails."""
        if self._closing:
            return
        for core in self.cores:
            self._send(core.replica, Shutdown())
        self._closing = True
        for core in self.cores:
            self.loop.remove_reader(core.process.sentinel)
        if self._dead is None:
            self._fail_all(EngineDeadError("the engine was shut down"))
        await asyncio.wait(set(self._receivers))
        deadline = time.monotonic() + timeout
        for core in self.cores:
            await self.loop.run_in_executor(None, core.process.join,
                                            max(0.0, deadline - time.monotonic()))
            if core.process.is_alive():
                logger.warning("the engine process (pid %d) did not stop in %.0f s; killing it",
                               core.process.pid, timeout)
                core.process.kill()
                core.process.join()
        close_cores(self._context, self._socket_dir, self.cores)
