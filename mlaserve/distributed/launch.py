"""The process groups of a parallel engine, and its control channel.

The world is `data_parallel_size` replicas of `tensor_parallel_size` consecutive ranks
(`ParallelLayout`): world rank = replica * T + tensor rank, on GPU cuda:(first + world rank).
The first rank of each replica schedules it (its engine core); the others are its workers.

Started by mlaserve on one host, whoever starts the world opens a `torch.distributed.TCPStore` on a
free port of 127.0.0.1 (the kernel picks it: no race between finding a port and binding it) and
passes the port on: the engine core of a tensor-parallel engine, or the API process of a data-
parallel one with expert parallelism. Started by torchrun (`TorchrunRank`, any number of hosts),
every process is a rank already and the store is torchrun's rendezvous (`env://`), and a rank's GPU
is its local rank. Every rank then joins the default process group through that store (NCCL on CUDA,
gloo on CPU): the data plane, on which the model's all-reduces, all-gathers and expert all-to-alls
run (`join_world` also cuts the tensor- and expert-parallel groups). Gloo groups on the CPU carry
the control plane: each replica's `ControlChannel` broadcasts its engine core's bytes (an encoded
step description) to the replica's ranks in one collective, and the engine cores' `lockstep` group
keeps replicas whose MoE layers exchange tokens stepping together. The store also carries each
rank's last words (`report_error`), so a core can name why a rank died.

Nothing here knows the engine: the engine's worker loop (engine/worker.py) builds on it.
"""

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mlaserve.distributed.expert_parallel import init_expert_parallel
from mlaserve.distributed.parallel_state import init_tensor_parallel

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
# The control group waits for rank 0's next step for as long as rank 0 is idle; a rank whose
# rank 0 is gone learns it from the closed connection or its parent watch, not from a timeout.
CONTROL_TIMEOUT = timedelta(days=365)
CONTROL_CAPACITY = 16 * 1024  # bytes of one broadcast; a longer message sends the rest after
LENGTH_BYTES = 8
PARENT_POLL_S = 0.5


def backend_for(device: torch.device) -> str:
    """The data-plane backend: NCCL between GPUs, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def create_store(world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store, on a free port of 127.0.0.1 (`store.port`)."""
    return dist.TCPStore(HOST, 0, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=False)


def connect_store(port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Another rank's client of rank 0's store."""
    return dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timeout)


@dataclass(frozen=True)
class TorchrunRank:
    """Where torchrun (torch.distributed.run) put this process: its environment."""

    rank: int
    local_rank: int  # its index on this host: the GPU it uses
    world_size: int
    local_world_size: int


def torchrun_rank() -> TorchrunRank | None:
    """This process's place if torchrun started it (its TORCHELASTIC_* and RANK variables; also
    inherited by the processes it spawns), else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    env = os.environ
    return TorchrunRank(int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]),
                        int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))


def torchrun_store(timeout: timedelta) -> dist.Store:
    """The store of torchrun's rendezvous (`env://`: MASTER_ADDR and MASTER_PORT), on any host."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return store


@dataclass(frozen=True)
class ParallelLayout:
    """How the world's ranks split the model: `data_parallel_size` replicas of
    `tensor_parallel_size` consecutive ranks; with `expert_parallel` the replicas' MoE layers
    share the routed experts (distributed/expert_parallel.py)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def core_rank(self, replica: int) -> int:
        """The world rank of replica `replica`'s engine core (its tensor rank 0)."""
        return replica * self.tensor_parallel_size


@dataclass
class ProcessGroups:
    """What `join_world` gives a rank besides the data plane.

    control: its replica's control channel (the core's step descriptions).
    lockstep: the engine cores' gloo group (expert parallelism only; None on workers).
    """

    control: "ControlChannel"
    lockstep: dist.ProcessGroup | None


def join_world(store: dist.Store, rank: int, layout: ParallelLayout, device: torch.device,
               timeout: timedelta) -> ProcessGroups:
    """Join the default process group (the data plane; `timeout` bounds each collective), then
    cut the tensor-parallel groups, the expert-parallel groups (if any) and the gloo control
    groups. Every rank of the world calls this; groups are created in the same order on all."""
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend_for(device), store=store, rank=rank,
                            world_size=layout.world_size, timeout=timeout, **kwargs)
    tp = layout.tensor_parallel_size
    init_tensor_parallel(tp)
    if layout.expert_parallel:
        init_expert_parallel(tp)
    if layout.data_parallel_size == 1:
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    else:
        control = None
        for replica in range(layout.data_parallel_size):
            ranks = list(range(replica * tp, (replica + 1) * tp))
            created = dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)
            if rank in ranks:
                control = created
    lockstep = None
    if layout.expert_parallel:
        cores = [layout.core_rank(r) for r in range(layout.data_parallel_size)]
        created = dist.new_group(cores, backend="gloo", timeout=timeout)
        lockstep = created if rank in cores else None
    return ProcessGroups(ControlChannel(control), lockstep)


class ControlChannel:
    """Rank 0's bytes to every rank of the group: one gloo broadcast of a uint8 CPU tensor.

    The buffer holds `CONTROL_CAPACITY` bytes: the message's length (8 bytes, little endian)
    and the message. A message that does not fit sends its rest in a second broadcast of just
    that size (a step that admits long prompts); every other message is one broadcast.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, payload: bytes) -> None:
        """Rank 0: broadcast `payload` (bytes of any length)."""
        fits = CONTROL_CAPACITY - LENGTH_BYTES
        buffer = torch.zeros(CONTROL_CAPACITY, dtype=torch.uint8)  # [capacity]
        head = len(payload).to_bytes(LENGTH_BYTES, "little") + payload[:fits]
        buffer[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(buffer, group_src=0, group=self.group)
        if len(payload) > fits:
            rest = torch.frombuffer(bytearray(payload[fits:]), dtype=torch.uint8)  # [n - fits]
            dist.broadcast(rest, group_src=0, group=self.group)

    def receive(self) -> bytes:
        """Another rank: wait for rank 0's next message."""
        fits = CONTROL_CAPACITY - LENGTH_BYTES
        buffer = torch.empty(CONTROL_CAPACITY, dtype=torch.uint8)  # [capacity]
        dist.broadcast(buffer, group_src=0, group=self.group)
        data = buffer.numpy().tobytes()
        length = int.from_bytes(data[:LENGTH_BYTES], "little")
        if length <= fits:
            return data[LENGTH_BYTES : LENGTH_BYTES + length]
        rest = torch.empty(length - fits, dtype=torch.uint8)  # [n - fits]
        dist.broadcast(rest, group_src=0, group=self.group)
        return data[LENGTH_BYTES:] + rest.numpy().tobytes()

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks that fit on every GPU)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())


def error_key(rank: int) -> str:
    return f"mlaserve/error/{rank}"


def report_error(store: dist.TCPStore, rank: int, message: str) -> None:
    """A rank's last words, for rank 0 to read when it sees the rank gone."""
    try:
        store.set(error_key(rank), message)
    except Exception:  # noqa: BLE001 - rank 0 (the store's host) may be gone already
        logger.debug("could not report the error to rank 0", exc_info=True)


def reported_error(store: dist.TCPStore, rank: int) -> str | None:
    """The error `rank` reported, if any."""
    key = error_key(rank)
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001 - a closing store: nothing to read
        return None


def exit_with_parent(parent_pid: int, what: str) -> None:
    """Exit this process soon after `parent_pid` is gone (this process is then re-parented):
    a killed parent leaves no orphan holding a GPU or a port. `what` names the process in the
    log line."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        logger.error("the parent process (pid %d) is gone; %s exits", parent_pid, what)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
