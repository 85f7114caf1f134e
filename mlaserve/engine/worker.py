"""Tensor-parallel workers: ranks 1 .. N-1 of one engine, each executing rank 0's step plans.

Protocol. The engine core (scheduler + runner) is rank 0: the API server's engine-core process,
or the process of an offline `LLM`. It decides every step alone. Its `WorkerGroup` spawns ranks
1 .. N-1 (multiprocessing "spawn", each given the core's resolved `EngineConfig`), which join the
process groups of distributed/launch.py through rank 0's store, build their shard of the model
and a full latent cache of the same number of blocks (the smallest that fits on every rank),
and then loop: receive a plan, launch it. Before rank 0 launches a step, its `PlanBroadcast`
encodes the step's plan (step_plan.py; msgspec msgpack) and broadcasts it once over the gloo
control group; every rank's `ModelRunner` executes the same plan, so every rank runs the same
forward and the same collectives in the same order, and keeps the same state of the requests
(by request id); rank 0 alone samples and broadcasts the ids on the data plane (runner.py,
`_sample`). A plan with `shutdown` set ends the loop. Under torchrun the other ranks are
torchrun's processes: rank 0 puts its config in the store and they read it there.

Failure. A worker whose step raises reports the error in rank 0's store and exits; a worker
that dies closes its connections. Either way rank 0's pending or next collective fails, and rank
0 raises one `ParallelEngineError` naming the worker and its error or exit status; the engine
is then stopped (no step can pair up the ranks' collectives again) and the other workers are
killed. A failure on rank 0 after a step went out is fatal likewise. A thread of rank 0 also
watches the workers' processes: where collectives do not fail when a peer dies (NCCL waits),
the engine-core process exits a few seconds after a worker died (`exit_on_failure`). Workers
ignore SIGINT and exit when their parent (rank 0) is gone.
"""

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from mlaserve.distributed import destroy_tensor_parallel
from mlaserve.distributed.expert_parallel import destroy_expert_parallel
from mlaserve.distributed.launch import (
    ControlChannel,
    connect_store,
    create_store,
    exit_with_parent,
    join_world,
    report_error,
    reported_error,
    torchrun_rank,
    torchrun_store,
)
from mlaserve.engine.data_parallel import Lockstep
from mlaserve.engine.engine_config import EngineConfig, cpu_threads_per_rank, rank_device
from mlaserve.engine.runner import load_runner
from mlaserve.engine.step_plan import StepPlan

logger = logging.getLogger(__name__)

STORE_TIMEOUT = timedelta(seconds=300)  # store operations (rendezvous, error reports)
CONFIG_KEY = "mlaserve/engine_config"  # rank 0's EngineConfig (pickled), for torchrun's ranks
DATA_TIMEOUT = timedelta(seconds=600)  # one data-plane collective (a long prefill on a CPU)
JOIN_POLL_S = 0.05  # how often rank 0 checks that the workers it waits for are alive
FAILURE_WAIT_S = 5.0  # how long rank 0 waits for a failed worker's exit to name its cause
HANG_GRACE_S = 5.0  # a worker died and the engine has not stopped: exit (exit_on_failure)
JOIN_TIMEOUT_S = 10.0  # graceful worker exit at shutdown, then they are killed


class ParallelEngineError(RuntimeError):
    """A rank of a parallel engine failed or died, or a step of an expert-parallel replica
    failed; the engine is stopped (its workers are gone) and fails every request. Never one
    request's fault, so never re-run apart."""


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


# ---- rank 0 --------------------------------------------------------------------------------
class WorkerGroup:
    """An engine core's handle on its replica's other ranks: start, liveness, shutdown.

    Under data parallelism with expert parallelism the core joins the whole world here even
    when its replica has no other rank (tensor_parallel_size 1), and `lockstep` is set.
    """

    def __init__(self, store: dist.TCPStore, first_rank: int,
                 processes: list[multiprocessing.Process]) -> None:
        self.store = store
        self.first_rank = first_rank  # this core's world rank
        self.processes = processes  # world rank first_rank + i is processes[i - 1]
        self.control: ControlChannel | None = None
        self.lockstep: Lockstep | None = None
        self.failure: str | None = None  # why the group is unusable
        self.exit_on_failure = False  # the engine-core process: exit if a death hangs it
        self.acknowledged = False  # the failure was raised to the engine's caller
        self._closing = False

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device, replica: int = 0,
              store_port: int | None = None, spare_cores: int = 0) -> "WorkerGroup":
        """Spawn the replica's ranks after this one and join the world with them (this process
        is the replica's engine core); on return the parallel groups are set for the model to
        be built. `store_port`: the world's store (data parallel), else this core opens one;
        `spare_cores`: as the core's (`cpu_threads_per_rank`)."""
        layout = config.layout
        first = layout.core_rank(replica)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's device for this rank
        torchrun = torchrun_rank()
        if torchrun is not None:  # the other ranks are torchrun's processes: nothing to spawn
            store = torchrun_store(STORE_TIMEOUT)
            store.set(CONFIG_KEY, pickle.dumps(config))
        elif store_port is None:
            store = create_store(layout.world_size, STORE_TIMEOUT)
        else:
            store = connect_store(store_port, layout.world_size, STORE_TIMEOUT)
        context = multiprocessing.get_context("spawn")
        processes = []
        for rank in range(first + 1, first + layout.tensor_parallel_size
                          if torchrun is None else first + 1):
            process = context.Process(
                target=run_worker, name=f"mlaserve-worker-{rank}", daemon=True,
                args=(config, rank, store.port, os.getpid(),
                      logging.getLogger().getEffectiveLevel(), spare_cores))
            process.start()
            processes.append(process)
        group = cls(store, first, processes)
        try:
            group._wait_joined()
            groups = join_world(store, first, layout, device, DATA_TIMEOUT)
            group.control = groups.control
            if groups.lockstep is not None:
                group.lockstep = Lockstep(groups.lockstep)
        except BaseException:
            group.shutdown(graceful=False)
            raise
        threading.Thread(target=group._watch, name="worker-watch", daemon=True).start()
        atexit.register(group.shutdown)  # an engine never shut down: stop its workers first
        logger.info("replica %d of %d: tensor parallel over %d ranks (worker pids %s)%s",
                    replica, layout.data_parallel_size, layout.tensor_parallel_size,
                    ", ".join(str(p.pid) for p in processes) or "none",
                    ", expert parallel" if layout.expert_parallel else "")
        return group

    def _wait_joined(self) -> None:
        """Wait until every worker is about to join the process group; a worker that dies
        first (an import or a device error) is an error here, not a rendezvous timeout."""
        for rank, process in enumerate(self.processes, start=self.first_rank + 1):
            while not self.store.check([f"mlaserve/joined/{rank}"]):
                if not process.is_alive():
                    process.join()
                    raise ParallelEngineError(self._describe(rank))
                time.sleep(JOIN_POLL_S)

    def _describe(self, rank: int) -> str:
        process = self.processes[rank - self.first_rank - 1]
        error = reported_error(self.store, rank)
        if error is not None:
            return f"tensor-parallel worker {rank} (pid {process.pid}) failed: {error}"
        return (f"tensor-parallel worker {rank} (pid {process.pid}) died "
                f"({_describe_exit(process.exitcode)})")

    def _watch(self) -> None:
        """Wait for a worker to exit; unless shutting down, that is the group's failure."""
        if not self.processes:
            return
        sentinels = {p.sentinel: rank
                     for rank, p in enumerate(self.processes, start=self.first_rank + 1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ready[0]]
        self.processes[rank - self.first_rank - 1].join()
        self.failure = self.failure or self._describe(rank)
        logger.error("%s", self.failure)
        if self.exit_on_failure:
            time.sleep(HANG_GRACE_S)
            if not self.acknowledged and not self._closing:
                logger.critical("%s; the engine did not stop within %.0f s (its collectives "
                                "wait for the dead rank): exiting", self.failure, HANG_GRACE_S)
                os._exit(1)

    def check(self) -> None:
        """Raise ParallelEngineError if the group has failed."""
        if self.failure is not None:
            self.acknowledged = True
            raise ParallelEngineError(self.failure)

    def wait_for_failure(self, timeout: float) -> str | None:
        """After a collective failed: the failed worker's description, once its exit is seen
        (None if every worker still runs after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.failure

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value`: the KV blocks every rank allocates (the first
        collective after loading: a worker that failed to load is named here), whether every
        rank captured its decode CUDA graphs."""
        assert self.control is not None
        try:
            return self.control.agree_min(value)
        except Exception as exc:
            failure = self.wait_for_failure(FAILURE_WAIT_S)
            if failure is None:
                raise
            raise ParallelEngineError(failure) from exc

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (told to exit if `graceful`, else killed), then leave the process
        groups. Idempotent."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        if graceful and self.control is not None and self.failure is None:
            try:
                self.control.send(msgspec.msgpack.encode(StepPlan(shutdown=True)))
            except Exception:  # noqa: BLE001 - a worker is gone: kill the rest below
                logger.warning("could not tell the tensor-parallel workers to exit",
                               exc_info=True)
        deadline = time.monotonic() + (JOIN_TIMEOUT_S if graceful else 0.0)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        destroy_tensor_parallel()
        destroy_expert_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


class PlanBroadcast:
    """Rank 0's side of the protocol: each step's plan to every other rank of the replica."""

    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, plan: StepPlan) -> None:
        """Broadcast `plan` (msgpack) to every worker; a failure here is fatal."""
        self.workers.check()
        try:
            self.workers.control.send(self._encoder.encode(plan))
        except BaseException as exc:
            error = self.out_of_step(exc)
            if error is exc:
                raise
            raise error from exc

    def out_of_step(self, exc: BaseException) -> BaseException:
        """A step failed after (or while) it went to the workers: the ranks' collectives no
        longer pair up, so the engine stops. Returns the exception to raise: one naming the
        worker that failed, if one did, else `exc` as a ParallelEngineError (a Ctrl-C stays a
        KeyboardInterrupt)."""
        workers = self.workers
        failure = workers.failure
        if failure is None and isinstance(exc, Exception):
            failure = workers.wait_for_failure(FAILURE_WAIT_S)
        if failure is None:
            failure = (f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: "
                       f"{exc}); the ranks are out of step")
            workers.failure = failure
        logger.error("%s; stopping the tensor-parallel engine", failure)
        workers.acknowledged = True
        workers.shutdown(graceful=False)
        return ParallelEngineError(failure) if isinstance(exc, Exception) else exc

    def shutdown(self) -> None:
        """Tell the workers to exit and wait for them (killed if they do not)."""
        self.workers.acknowledged = True
        self.workers.shutdown(graceful=True)


# ---- ranks 1 .. N-1 --------------------------------------------------------------------------
def run_worker(config: EngineConfig, rank: int, store_port: int, parent_pid: int,
               log_level: int, spare_cores: int = 0) -> None:
    """Process entry of world rank `rank`, spawned by its engine core: join the groups, load
    the shard, run the core's steps."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine core's to handle
    exit_with_parent(parent_pid, f"worker {rank}")
    store = connect_store(store_port, config.layout.world_size, STORE_TIMEOUT)
    _serve_steps(config, rank, rank, store, spare_cores)


def run_torchrun_worker() -> int:
    """A rank > 0 that torchrun started (`mlaserve serve` on every rank): run its engine core's
    steps, with the config rank 0 put in the store, until the core shuts the engine down; the
    exit status."""
    place = torchrun_rank()
    assert place is not None and place.rank > 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine core's to handle
    store = torchrun_store(STORE_TIMEOUT)
    config = pickle.loads(store.get(CONFIG_KEY))
    _serve_steps(config, place.rank, place.local_rank, store)
    return 0


def _serve_steps(config: EngineConfig, rank: int, local_rank: int, store: dist.Store,
                 spare_cores: int = 0) -> None:
    """Join the world as `rank` (GPU `local_rank` from the config's device), load this rank's
    shard and execute its engine core's plans until told to shut down; a failure is reported in
    the store and exits the process."""
    try:
        device = rank_device(config.device, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(cpu_threads_per_rank(config.layout.world_size, spare_cores))
        store.set(f"mlaserve/joined/{rank}", "1")
        groups = join_world(store, rank, config.layout, device, DATA_TIMEOUT)
        run_plans(config, device, groups.control)
    except BaseException as exc:  # noqa: BLE001 - reported to the engine core, which stops
        logger.exception("worker %d failed", rank)
        report_error(store, rank, f"{type(exc).__name__}: {exc}")
        os._exit(1)
    destroy_tensor_parallel()
    destroy_expert_parallel()
    dist.destroy_process_group()


def run_plans(config: EngineConfig, device: torch.device, control: ControlChannel) -> None:
    """Load this rank's runner, then receive and launch rank 0's plans until told to shut
    down; a step's results are collected after the next is launched (at most two steps in
    flight, as on rank 0)."""
    runner = load_runner(config, device, control.agree_min)
    decoder = msgspec.msgpack.Decoder(StepPlan)
    pending = None
    while True:
        plan = decoder.decode(control.receive())
        if plan.shutdown:
            return
        launched = runner.launch(plan)
        if launched is None:  # an idle plan
            continue
        if pending is not None:
            runner.collect(pending)
        pending = launched
