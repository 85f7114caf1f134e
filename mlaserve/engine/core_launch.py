"""Starting engine-core processes (one per data-parallel replica) and waiting until they load.

Each core gets two ZeroMQ ipc:// sockets in the API process's socket directory (input-R, which
the core binds, and output-R, which this process binds), so the API process knows which replica
every message comes from. The cores are spawned (CUDA cannot be forked) and load together;
`wait_ready` returns their `EngineInfo`s once every one reported `Ready`, and fails as soon as
one reports `Failed` or exits, naming why: the replicas are one engine.
"""

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
from collections import deque
from dataclasses import dataclass, field, replace

import msgspec
import zmq
import zmq.asyncio

from mlaserve.engine.args import EngineArgs
from mlaserve.engine.core_process import CoreMessage, Failed, Ready, run_engine_core
from mlaserve.engine.engine_config import rank_device, resolve_device
from mlaserve.engine.messages import EngineInfo, SchedulerStats

LAST_WORDS_S = 1.0  # how long a core that exited may take to deliver its Failed message


class EngineLoadError(RuntimeError):
    """The engine process could not load the model; the message says why."""


@dataclass(eq=False)
class CoreProcess:
    """One engine-core process (a data-parallel replica) and its two sockets."""

    replica: int
    process: multiprocessing.Process
    input: zmq.Socket
    output: zmq.asyncio.Socket
    stats: SchedulerStats = field(default_factory=SchedulerStats)  # as of its latest message
    stats_waiters: deque = field(default_factory=deque)
    fatal: str | None = None  # the reason the core sent before exiting

    @property
    def name(self) -> str:
        return "the engine process" + (f" of replica {self.replica}" if self.replica else "")


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"


def spawn_core(args: EngineArgs, replica: int, socket_dir: str, context: zmq.Context,
               store_port: int | None) -> CoreProcess:
    """Start replica `replica`'s engine-core process with its two sockets. Without expert
    parallelism a replica is an engine of its own: data_parallel_size 1, on its own GPUs."""
    input_address = f"ipc://{socket_dir}/input-{replica}"
    output_address = f"ipc://{socket_dir}/output-{replica}"
    input_socket = context.socket(zmq.PUSH)
    input_socket.setsockopt(zmq.SNDHWM, 0)
    input_socket.connect(input_address)
    output_socket = zmq.asyncio.Context.shadow(context.underlying).socket(zmq.PULL)
    output_socket.setsockopt(zmq.RCVHWM, 0)
    output_socket.bind(output_address)
    core_args = args
    if args.data_parallel_size > 1 and not args.enable_expert_parallel:
        device = rank_device(resolve_device(args.device), replica * args.tensor_parallel_size)
        core_args = replace(args, data_parallel_size=1, device=str(device))
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, name=f"mlaserve-engine-core-{replica}", daemon=True,
        args=(core_args, input_address, output_address, os.getpid(),
              logging.getLogger().getEffectiveLevel(), replica, store_port))
    core = CoreProcess(replica, process, input_socket, output_socket)
    process.start()
    return core


async def wait_ready(cores: list[CoreProcess]) -> list[EngineInfo]:
    """Every core's first message, its EngineInfo; EngineLoadError naming the first core that
    could not load the model (it sent `Failed`, or exited without a word)."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future = loop.create_future()
    for core in cores:
        loop.add_reader(core.process.sentinel,
                        lambda c=core: exited.done() or exited.set_result(c))
    received = {asyncio.ensure_future(core.output.recv()): core for core in cores}
    infos: dict[int, EngineInfo] = {}
    try:
        while len(infos) < len(cores):
            pending = {r for r in received if not r.done()}
            done, _ = await asyncio.wait(pending | {exited},
                                         return_when=asyncio.FIRST_COMPLETED)
            for future in done & set(received):
                message = msgspec.msgpack.decode(future.result(), type=CoreMessage)
                core = received[future]
                if isinstance(message, Failed):
                    raise EngineLoadError(_named(core, cores, message.error))
                if isinstance(message, Ready):
                    infos[core.replica] = message.info
            if exited.done():
                core = exited.result()
                last = next(r for r, c in received.items() if c is core)
                if not last.done():  # its last words may still be on the way
                    await asyncio.wait({last}, timeout=LAST_WORDS_S)
                if last.done() and core.replica not in infos:
                    message = msgspec.msgpack.decode(last.result(), type=CoreMessage)
                    if isinstance(message, Failed):
                        raise EngineLoadError(_named(core, cores, message.error))
                await loop.run_in_executor(None, core.process.join, 5)
                raise EngineLoadError(_named(core, cores, (
                    f"{core.name} exited with {describe_exit(core.process.exitcode)} while "
                    "loading the model")))
    finally:
        for core in cores:
            loop.remove_reader(core.process.sentinel)
        exited.cancel()
        for future in received:
            future.cancel()
    return [infos[core.replica] for core in cores]


def _named(core: CoreProcess, cores: list[CoreProcess], error: str) -> str:
    return error if len(cores) == 1 else f"replica {core.replica}: {error}"


def close_cores(context: zmq.Context, socket_dir: str, cores: list[CoreProcess]) -> None:
    """Close every core's sockets, the context and the socket directory."""
    for core in cores:
        core.input.close(linger=0)
        core.output.close(linger=0)
    context.term()
    shutil.rmtree(socket_dir, ignore_errors=True)
