"""The tensor-parallel group of this process: its rank, its size and its torch.distributed group.

One process per rank. The caller initialises the default process group (NCCL on CUDA, gloo on
CPU: the caller's choice of backend), then `init_tensor_parallel(size)` cuts the world into
groups of `size` consecutive ranks; this process's group becomes the current one, which every
tensor-parallel layer captures when it is constructed. Without that call the group is the
single-process default (rank 0 of 1, no process group), whose collectives are the identity. A
group of one rank with a process group (`TensorParallelGroup(group=dist.group.WORLD)` in a world
of one) runs the parallel path itself, every collective included: the way to check on one GPU
that the collectives work inside CUDA graphs.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks one model replica is split across.

    rank: this process's index in the group, 0 .. size - 1 (it holds shard `rank` of every
        split weight).
    size: how many ranks split the model (`--tensor-parallel-size`).
    group: the torch.distributed group of those ranks; None when size is 1 (no collectives).
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def communicates(self) -> bool:
        """Whether the layers take the parallel path and run collectives (a process group is
        set, even of one rank)."""
        return self.group is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group's ranks, in place; returns x (untouched without a group).

        Args:
            x: any shape and dtype the backend reduces (the same shape on every rank).
        """
        if self.communicates:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's x along dim in rank order; x itself without a group.

        Args:
            x: [..., n, ...] with n at `dim`, the same shape on every rank.

        Returns:
            [..., size * n, ...], on every rank.
        """
        if not self.communicates:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int, dst: int = 0) -> torch.Tensor | None:
        """Concatenate every rank's x along dim in rank order, on group rank `dst` only (None
        on the others; x itself without a group).

        Args:
            x: [..., n, ...] with n at `dim`, the same shape on every rank.

        Returns:
            [..., size * n, ...] on rank `dst`.
        """
        if not self.communicates:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == dst else None
        dist.gather(x, parts, group_dst=dst, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite x on every rank with group rank `src`'s x, in place; returns x.

        Args:
            x: any shape and dtype, the same on every rank (the values of rank `src` count).
        """
        if self.communicates:
            dist.broadcast(x, group_src=src, group=self.group)
        return x


_DEFAULT = TensorParallelGroup()
_tp_group = _DEFAULT


def get_tp_group() -> TensorParallelGroup:
    """This process's tensor-parallel group (the size-1 default unless initialised)."""
    return _tp_group


def init_tensor_parallel(tensor_parallel_size: int | None = None) -> TensorParallelGroup:
    """Split the initialised default process group into tensor-parallel groups.

    Ranks 0 .. size - 1 form the first group, size .. 2 * size - 1 the next, and so on (a later
    data-parallel dimension takes the groups as its replicas). Every process of the world must
    call this, with the same size.

    Args:
        tensor_parallel_size: ranks per group; None: the whole world is one group.

    Returns:
        This process's group, now also `get_tp_group()`.
    """
    global _tp_group
    if not dist.is_initialized():
        raise RuntimeError("init_tensor_parallel needs torch.distributed.init_process_group "
                           "first (nccl on CUDA, gloo on CPU)")
    world_size, world_rank = dist.get_world_size(), dist.get_rank()
    size = tensor_parallel_size or world_size
    if size < 1 or world_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the world size "
                         f"{world_size}")
    if size == 1:
        group = None  # collectives are the identity
    elif size == world_size:
        group = dist.group.WORLD
    else:
        group = None
        for start in range(0, world_size, size):  # every rank creates every group, in order
            ranks = list(range(start, start + size))
            created = dist.new_group(ranks)
            if world_rank in ranks:
                group = created
    _tp_group = TensorParallelGroup(rank=world_rank % size, size=size, group=group)
    return _tp_group


def destroy_tensor_parallel() -> None:
    """Return to the size-1 default. The process groups stay the caller's to destroy
    (`torch.distributed.destroy_process_group()` destroys them all)."""
    global _tp_group
    _tp_group = _DEFAULT


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """`get_tp_group().all_reduce(x)`: the in-place sum over the current group."""
    return _tp_group.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`get_tp_group().all_gather(x, dim)`: concatenation over the current group."""
    return _tp_group.all_gather(x, dim)
