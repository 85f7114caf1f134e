"""The engine-core process: an `EngineCore` in a busy loop behind two ZeroMQ sockets.

Design. The API process (core_client.py) starts this process with multiprocessing's "spawn"
context (CUDA cannot be forked) and two ipc:// addresses. Requests, aborts and control messages
arrive on a PULL socket that this process binds; each step's outputs leave on a PUSH socket that
it connects, as one message holding the step's `EngineCoreOutput`s (token deltas) and the core's
`SchedulerStats`. Each side binds the socket it reads and connects the one it writes, so a send
never waits for the peer: a connecting socket queues until the connection is up. While there is
work the loop drains the inbox without blocking between steps; when idle it reports its stats
once and blocks on the inbox. ZeroMQ brings framing, queueing and liveness for free and msgspec's
msgpack encodes the typed Structs of messages.py fast, with schema-checked decoding, so no wire
protocol is written here. The core's `SchedulerStats` leave with every step's outputs and,
whenever they changed, after a step without outputs or after adds and aborts handled while idle,
so /metrics never shows a request that is gone. A request that the core refuses (or cannot even
decode) comes back at once as an output with the error.

Lifetime. The first message out is `Ready` (with the `EngineInfo`) once the model is loaded and
warmed up, or `Failed` with the reason. The process ignores SIGINT (a Ctrl-C reaches the whole
process group; the API process drains its streams, then sends `Shutdown`), and a thread exits it
when its parent dies, so a killed server leaves no orphan holding the GPU. Under tensor
parallelism this process is rank 0 and the parent of the workers (engine/worker.py), which exit
with it the same way; a failed or dead worker ends the loop with `Failed` naming it, and if a
dead worker hangs the collectives (NCCL), the worker watch exits this process within seconds.

Test hook: with MLASERVE_FAULT_FILE=PATH set, the model runner checks for PATH before each step
it launches. The file's first line is an error message, any further lines are request ids; once
read, the file is deleted and those requests become poisonous: every step that carries one of
them raises RuntimeError(message), as a request whose data breaks the step would. With no ids
listed, the requests of the step being launched are the poisonous ones. So the poisoned requests
fail (see core.py: a request fails when a step that carried it alone failed) and the others in
their steps go on.
"""

import gc
import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path

import msgspec
import zmq

from mlaserve.distributed.launch import exit_with_parent
from mlaserve.engine.args import EngineArgs
from mlaserve.engine.core import EngineCore
from mlaserve.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineInfo, SchedulerStats

logger = logging.getLogger(__name__)

FAULT_FILE_ENV = "MLASERVE_FAULT_FILE"
# On the CPU, the cores an engine leaves to the API process beside it (and to the grammar and
# template workers): torch's OpenMP threads stall a whole step whenever one of them shares a
# core with another busy process (on 2 cores, 10 ms steps took up to 180 ms beside a grammar
# compile; with one core left, 27 ms)
SERVER_SPARE_CORES = 1
IDLE_POLL_MS = 500  # an idle core checks its tensor-parallel workers this often
LINGER_MS = 2000  # how long the last messages may take to leave when the process exits


# ---- API process -> core ---------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag=True, array_like=True):
    """Ask for a `Stats` reply; it reflects every message sent before this one."""


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Wake(msgspec.Struct, tag=True, array_like=True):
    """Another replica got a request: step together now (expert parallelism)."""


ClientMessage = AddRequest | AbortRequests | GetStats | Shutdown | Wake


# ---- core -> API process ---------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The core cannot go on (the model did not load, or the loop broke); the process exits."""

    error: str


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """One step's outputs (empty when the core reports its stats on going idle)."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class Stats(msgspec.Struct, tag=True, array_like=True):
    stats: SchedulerStats


CoreMessage = Ready | Failed | StepOutputs | Stats


def run_engine_core(args: EngineArgs, input_address: str, output_address: str, parent_pid: int,
                    log_level: int, replica: int = 0, store_port: int | None = None) -> None:
    """Process entry: load the core, report `Ready` or `Failed`, then serve until `Shutdown`.

    replica, store_port: this core's data-parallel replica and, under expert parallelism, the
    world's store (`EngineCore`)."""
    prefix = f"dp{replica} " if args.data_parallel_size > 1 else ""
    logging.basicConfig(level=log_level, format=f"%(levelname)s {prefix}%(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent_pid, "the engine core")
    # started as a daemon (its parent's exit ends it), this process starts children of its own
    # (tensor-parallel workers, grammar sandbox workers), which multiprocessing forbids a
    # daemon; they are daemons, and exit with it
    multiprocessing.current_process().daemon = False
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.bind(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        try:
            core = EngineCore(args, replica, store_port, spare_cores=SERVER_SPARE_CORES)
            if core.workers is not None:
                core.workers.exit_on_failure = True  # a dead worker may hang NCCL: exit
            core.warm_up()
        except Exception as exc:  # noqa: BLE001 - reported to the API process, which stops
            outbox.send(encoder.encode(Failed(f"{type(exc).__name__}: {exc}")))
            sys.exit(1)
        _install_fault_hook(core)
        # what start-up built lives as long as the process: out of the collector's reach, a
        # full collection no longer walks it (it paused steps for ~250 ms on the CPU)
        gc.collect()
        gc.freeze()
        outbox.send(encoder.encode(Ready(core.info)))
        try:
            CoreLoop(core, inbox, outbox).run()
        except Exception as exc:
            logger.exception("the engine core loop failed")
            outbox.send(encoder.encode(Failed(f"{type(exc).__name__}: {exc}")))
            sys.exit(1)
        core.shutdown()  # tensor-parallel workers exit
    finally:
        context.destroy(linger=LINGER_MS)


def _install_fault_hook(core: EngineCore) -> None:
    """The MLASERVE_FAULT_FILE test hook (see the module docstring); off when the env is unset."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return
    launch = core.runner.launch
    poisoned: dict[str, str] = {}  # request id -> the error its steps raise

    def launch_or_fail(plan, *args):
        try:
            message, *request_ids = Path(path).read_text().splitlines() or [""]
        except FileNotFoundError:
            pass
        else:
            os.unlink(path)
            for request_id in request_ids or plan.request_ids:
                poisoned[request_id] = message
        for request_id in plan.request_ids:
            if request_id in poisoned:
                raise RuntimeError(poisoned[request_id])
        return launch(plan, *args)

    core.runner.launch = launch_or_fail


class CoreLoop:
    """Drain the inbox, step, send the step's outputs; block on the inbox when idle."""

    def __init__(self, core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.rejected: list[EngineCoreOutput] = []  # requests the core refused, sent next
        self.sent_stats: SchedulerStats | None = None  # the stats last sent

    def run(self) -> None:
        core = self.core
        while True:
            if core.lockstep is not None:  # the replicas step together (data_parallel.py)
                if not core.lockstep.busy:
                    self.inbox.poll(IDLE_POLL_MS)  # a message, or the idle replicas' tick
                    core.check_workers()
            elif not core.has_unfinished and core.workers is None:
                self.inbox.poll()  # idle: wait for a message (the parent watch ends a wait)
            elif not core.has_unfinished:
                while not self.inbox.poll(IDLE_POLL_MS):
                    core.check_workers()  # a worker that dies while the core idles stops it
            outputs, stop = core.step_together(stopping=not self.handle_messages())
            if stop:
                return
            if self.rejected:
                outputs, self.rejected = self.rejected + outputs, []
            stats = core.stats()
            if outputs or stats != self.sent_stats:
                self.send(StepOutputs(outputs, stats))
                self.sent_stats = stats

    def handle_messages(self) -> bool:
        """Handle every message waiting, without blocking; False once told to shut down."""
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            try:
                message = self.decoder.decode(frame.buffer)
            except msgspec.DecodeError as exc:  # ValidationError included
                self.refuse_undecodable(frame.bytes, exc)
                continue
            if isinstance(message, AddRequest):
                try:
                    self.core.add_request(message.request)
                except ValueError as exc:
                    self.rejected.append(EngineCoreOutput(
                        message.request.request_id, [], finish_reason="abort", error=str(exc),
                        rejected=True))
            elif isinstance(message, AbortRequests):
                self.core.abort_requests(message.request_ids)
            elif isinstance(message, GetStats):
                self.send(Stats(self.core.stats()))
            elif isinstance(message, Shutdown):
                return False

    def refuse_undecodable(self, data: bytes, exc: msgspec.DecodeError) -> None:
        """A message that does not decode: refuse it if it names a request, else drop it."""
        request_id = None
        try:
            tag, (request_id, *_) = msgspec.msgpack.decode(data)
            request_id = request_id if tag == "AddRequest" and isinstance(request_id, str) else None
        except (msgspec.DecodeError, TypeError, ValueError):
            pass
        if request_id is None:
            logger.error("dropped a message that does not decode: %s", exc)
            return
        self.rejected.append(EngineCoreOutput(request_id, [], finish_reason="abort",
                                              error=f"the request does not decode: {exc}",
                                              rejected=True))

    def send(self, message: CoreMessage) -> None:
        self.outbox.send(self.encoder.encode(message), copy=False)
