"""Tensor-parallel workers: ranks 1 .. N-1 of one engine, each launching rank 0's steps.

Protocol. The engine core (scheduler + runner) is rank 0: the API server's engine-core process,
or the process of an offline `LLM`. It decides every step alone. Its `WorkerGroup` spawns ranks
1 .. N-1 (multiprocessing "spawn"), which join the process groups of distributed/launch.py
through rank 0's store, build their shard of the model and a full latent cache of the same
number of blocks (the smallest that fits on every rank), and then loop: receive a step, mirror
it, launch it. Before rank 0's runner launches a step, its `StepBroadcast` encodes the step's
description (msgspec msgpack) and broadcasts it once over the gloo control group: the requests
that left since the last step (finished, aborted, preempted or taken back: the worker frees
their rows), the requests joining (prompt ids, sampling parameters, seed), and for each
scheduled request its computed tokens, its scheduled tokens, the output ids and block ids it has
gained since the workers last saw it and its placeholders, then which requests sample. A worker
applies that to its mirrored `Request`s and calls the same `ModelRunner.launch`, so every rank
runs the same forward and the same collectives in the same order; rank 0 alone samples and
broadcasts the ids on the data plane (runner.py, `_sample`). A description with `shutdown` set
ends the loop. Request ids travel once, with the join; steps name requests by small handles.

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
import signal
import threading
import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from mlaserve.config import ModelConfig
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
from mlaserve.engine.args import (
    EngineArgs,
    cpu_threads_per_rank,
    model_dir_of,
    parallel_layout,
    rank_device,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from mlaserve.engine.data_parallel import Lockstep
from mlaserve.engine.request import Request, SamplingParams
from mlaserve.engine.runner import ModelRunner, load_runner
from mlaserve.engine.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

STORE_TIMEOUT = timedelta(seconds=300)  # store operations (rendezvous, error reports)
DATA_TIMEOUT = timedelta(seconds=600)  # one data-plane collective (a long prefill on a CPU)
JOIN_POLL_S = 0.05  # how often rank 0 checks that the workers it waits for are alive
FAILURE_WAIT_S = 5.0  # how long rank 0 waits for a failed worker's exit to name its cause
HANG_GRACE_S = 5.0  # a worker died and the engine has not stopped: exit (exit_on_failure)
JOIN_TIMEOUT_S = 10.0  # graceful worker exit at shutdown, then they are killed


class ParallelEngineError(RuntimeError):
    """A rank of a parallel engine failed or died, or a step of an expert-parallel replica
    failed; the engine is stopped (its workers are gone) and fails every request. Never one
    request's fault, so never re-run apart."""


# ---- the step description: rank 0 -> every other rank, once per step -------------------------
class JoiningRequest(msgspec.Struct, array_like=True):
    """A request the workers do not hold yet (new, or back after leaving)."""

    handle: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_seed: int
    eos_token_ids: list[int]


class ScheduledRequest(msgspec.Struct, array_like=True):
    """One scheduled request's state as rank 0's runner reads it at launch."""

    handle: int
    num_computed_tokens: int
    num_new_tokens: int  # 1 for a decode
    new_output_token_ids: list[int]  # known output ids the workers have not seen
    num_output_placeholders: int
    new_block_ids: list[int]  # block ids the workers have not seen
    num_prompt_logprobs: int = -1  # len(request.prompt_logprobs); -1: none asked for


class StepDescription(msgspec.Struct, array_like=True):
    leaving: list[int]
    joining: list[JoiningRequest]
    decodes: list[ScheduledRequest]
    prefills: list[ScheduledRequest]
    sampling: list[int]  # handles of ScheduledBatch.sampling_requests, in order
    shutdown: bool = False
    idle: bool = False  # no batch: join the other replicas' expert exchanges (Lockstep)


class _Mirror:
    """What the workers know of one of rank 0's requests."""

    __slots__ = ("handle", "num_outputs", "num_blocks")

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.num_outputs = 0
        self.num_blocks = 0


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
    def start(cls, args: EngineArgs, device: torch.device, replica: int = 0,
              store_port: int | None = None, spare_cores: int = 0) -> "WorkerGroup":
        """Spawn the replica's ranks after this one and join the world with them (this process
        is the replica's engine core); on return the parallel groups are set for the model to
        be built. `store_port`: the world's store (data parallel), else this core opens one;
        `spare_cores`: as the core's (`cpu_threads_per_rank`)."""
        layout = parallel_layout(args)
        first = layout.core_rank(replica)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's device for this rank
        torchrun = torchrun_rank()
        if torchrun is not None:  # the other ranks are torchrun's processes: nothing to spawn
            store = torchrun_store(STORE_TIMEOUT)
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
                args=(args, rank, store.port, os.getpid(),
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
                self.control.send(msgspec.msgpack.encode(StepDescription([], [], [], [], [],
                                                                         shutdown=True)))
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


class StepBroadcast:
    """Rank 0's side of the protocol: describe each step for the workers and send it."""

    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers
        self._encoder = msgspec.msgpack.Encoder()
        self._mirrors: dict[Request, _Mirror] = {}  # the requests the workers hold
        self._leaving: list[int] = []  # handles released since the last step
        self._next_handle = 0

    def release(self, request: Request) -> None:
        """The request left the runner's batch: the workers forget it with the next step."""
        mirror = self._mirrors.pop(request, None)
        if mirror is not None:
            self._leaving.append(mirror.handle)

    def send(self, batch: ScheduledBatch) -> None:
        """Broadcast the description of `batch` (not advanced yet) to every worker."""
        self.workers.check()
        try:  # the mirrors change as the description is built: a failure here is fatal too
            joining: list[JoiningRequest] = []
            decodes = [self._scheduled(r, 1, joining) for r in batch.decodes]
            prefills = [self._scheduled(r, n, joining) for r, n in batch.prefills]
            step = StepDescription(self._leaving, joining, decodes, prefills,
                                   [self._mirrors[r].handle for r in batch.sampling_requests])
            self._leaving = []
            self.workers.control.send(self._encoder.encode(step))
        except BaseException as exc:
            error = self.out_of_step(exc)
            if error is exc:
                raise
            raise error from exc

    def send_idle(self) -> None:
        """Tell the workers to join the other replicas' expert exchanges with no batch."""
        self.workers.check()
        try:
            self.workers.control.send(self._encoder.encode(
                StepDescription(self._leaving, [], [], [], [], idle=True)))
            self._leaving = []
        except BaseException as exc:
            error = self.out_of_step(exc)
            if error is exc:
                raise
            raise error from exc

    def _scheduled(self, request: Request, num_new_tokens: int,
                   joining: list[JoiningRequest]) -> ScheduledRequest:
        mirror = self._mirrors.get(request)
        if mirror is None:
            mirror = self._mirrors[request] = _Mirror(self._next_handle)
            self._next_handle += 1
            joining.append(JoiningRequest(
                mirror.handle, request.request_id, request.prompt_token_ids, request.params,
                request.sample_seed, list(request.eos_token_ids)))
        outputs, blocks = request.output_token_ids, request.block_ids
        if len(blocks) < mirror.num_blocks:
            raise RuntimeError(f"request {request.request_id} lost blocks without leaving the "
                               "runner's batch")
        scheduled = ScheduledRequest(
            mirror.handle, request.num_computed_tokens, num_new_tokens,
            outputs[mirror.num_outputs :], request.num_output_placeholders,
            blocks[mirror.num_blocks :],
            -1 if request.prompt_logprobs is None else len(request.prompt_logprobs))
        mirror.num_outputs, mirror.num_blocks = len(outputs), len(blocks)
        return scheduled

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
def run_worker(args: EngineArgs, rank: int, store_port: int, parent_pid: int,
               log_level: int, spare_cores: int = 0) -> None:
    """Process entry of world rank `rank`, spawned by its engine core: join the groups, load
    the shard, run the core's steps."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine core's to handle
    exit_with_parent(parent_pid, f"worker {rank}")
    layout = parallel_layout(args)
    store = connect_store(store_port, layout.world_size, STORE_TIMEOUT)
    _serve_steps(args, rank, rank, store, spare_cores)


def run_torchrun_worker(args: EngineArgs) -> int:
    """A rank > 0 that torchrun started (`mlaserve serve` on every rank): run its engine core's
    steps until the core shuts the engine down; the exit status."""
    place = torchrun_rank()
    assert place is not None and place.rank > 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine core's to handle
    _serve_steps(args, place.rank, place.local_rank, torchrun_store(STORE_TIMEOUT))
    return 0


def _serve_steps(args: EngineArgs, rank: int, local_rank: int, store: dist.Store,
                 spare_cores: int = 0) -> None:
    """Join the world as `rank` (GPU `local_rank` from --device's), load this rank's shard and
    run its engine core's steps until told to shut down; a failure is reported in the store and
    exits the process."""
    layout = parallel_layout(args)
    try:
        device = rank_device(resolve_device(args.device), local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(cpu_threads_per_rank(layout.world_size, spare_cores))
        store.set(f"mlaserve/joined/{rank}", "1")
        groups = join_world(store, rank, layout, device, DATA_TIMEOUT)
        Worker(args, device, groups.control).run()
    except BaseException as exc:  # noqa: BLE001 - reported to the engine core, which stops
        logger.exception("worker %d failed", rank)
        report_error(store, rank, f"{type(exc).__name__}: {exc}")
        os._exit(1)
    destroy_tensor_parallel()
    destroy_expert_parallel()
    dist.destroy_process_group()


class Worker:
    """One rank's runner, driven by rank 0's step descriptions."""

    def __init__(self, args: EngineArgs, device: torch.device, control: ControlChannel) -> None:
        config = ModelConfig.from_pretrained(model_dir_of(args), args.hf_overrides)
        dtype = resolve_dtype(args.dtype, config, device)
        max_model_len = resolve_max_model_len(args, config)
        self.control = control
        self.runner: ModelRunner = load_runner(args, config, device, dtype, max_model_len,
                                               control.agree_min)
        self.requests: dict[int, Request] = {}  # handle -> mirror of rank 0's request
        self._decoder = msgspec.msgpack.Decoder(StepDescription)

    def run(self) -> None:
        """Receive, mirror and launch steps until told to shut down; a step's results are
        collected after the next is launched (at most two steps in flight, as on rank 0)."""
        pending = None
        while True:
            step = self._decoder.decode(self.control.receive())
            if step.shutdown:
                return
            if step.idle:
                for handle in step.leaving:
                    self.runner.release(self.requests.pop(handle))
                self.runner.join_expert_parallel()
                continue
            launched = self.runner.launch(self.apply(step))
            if pending is not None:
                self.runner.collect(pending)
            pending = launched

    def apply(self, step: StepDescription) -> ScheduledBatch:
        """Update the mirrored requests as the description says; the step's batch."""
        for handle in step.leaving:
            self.runner.release(self.requests.pop(handle))
        for joining in step.joining:
            self.requests[joining.handle] = Request(
                joining.request_id, None, joining.prompt_token_ids, joining.params,
                sample_seed=joining.sample_seed, eos_token_ids=tuple(joining.eos_token_ids))
        batch = ScheduledBatch()
        batch.decodes = [self._update(s) for s in step.decodes]
        batch.prefills = [(self._update(s), s.num_new_tokens) for s in step.prefills]
        batch.sampling_requests = [self.requests[h] for h in step.sampling]
        return batch

    def _update(self, scheduled: ScheduledRequest) -> Request:
        request = self.requests[scheduled.handle]
        request.num_computed_tokens = scheduled.num_computed_tokens
        request.output_token_ids.extend(scheduled.new_output_token_ids)
        request.num_output_placeholders = scheduled.num_output_placeholders
        request.block_ids.extend(scheduled.new_block_ids)
        if scheduled.num_prompt_logprobs >= 0:
            request.prompt_logprobs = [None] * scheduled.num_prompt_logprobs
        return request
