"""The expert-parallel group: data-parallel attention replicas whose MoE layers share experts.

With `--data-parallel-size N --enable-expert-parallel` each of the N ranks runs its own
attention replica over its own requests (its own latent cache, no replication) and owns
n_routed_experts / N of every MoE layer's routed experts (rank r: experts r * E / N onward).
Tokens meet their experts through two collectives per MoE layer (`expert_parallel_moe` in
model/expert_parallel.py): `dispatch`, an all-gather of every rank's token rows (each row with
its routing) into a buffer of a fixed number of rows per rank, and `combine`, a reduce-scatter
that sums every rank's expert outputs for a token back on the token's rank. Their sizes are
fixed by the step's capacity, agreed by every replica before the step (`Lockstep`), never by
routing counts read on the host, so CUDA graphs capture them. A rank with no tokens in a step
still joins every exchange with padding rows. The router is replicated.

With tensor parallelism inside each replica (`-tp T -dp N`, world rank = replica * T + tensor
rank) the expert-parallel groups are the ranks of equal tensor rank, one per replica: rank t of
every replica holds the tensor shard t (moe_intermediate_size / T columns) of the same E / N
experts, so the tokens travel between equal shards and each replica all-reduces the partial sums
as a tensor-parallel MoE does. Without `init_expert_parallel` the group is the single-process
default (rank 0 of 1, no process group), whose model holds every expert and never communicates;
a group of one rank with a process group takes the expert-parallel path, collectives included.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor forms of the two collectives (same arguments); 2.11 has the old
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class ExpertParallelGroup:
    """The ranks the routed experts are split across.

    rank: this process's index, 0 .. size - 1; it owns experts rank * E / size onward.
    size: the number of ranks (the data-parallel size).
    group: their torch.distributed group; None when size is 1 (no exchanges).
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def communicates(self) -> bool:
        """Whether the MoE layers take the expert-parallel path (a process group is set, even
        of one rank)."""
        return self.group is not None

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, in rank order, on every rank (an all-gather).

        Args:
            rows: [C, W], the same C and W on every rank.

        Returns:
            [size * C, W]: rank r's rows at r * C onward.
        """
        gathered = rows.new_empty((self.size * rows.shape[0], *rows.shape[1:]))
        _all_gather_single(gathered, rows.contiguous(), group=self.group)
        return gathered

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of every rank's rows, each rank keeping its own run (a
        reduce-scatter, `dispatch` reversed).

        Args:
            rows: [size * C, W], run r for rank r.

        Returns:
            [C, W]: sum over ranks of their run for this rank, in rows' dtype.
        """
        mine = rows.new_empty((rows.shape[0] // self.size, *rows.shape[1:]))
        _reduce_scatter_single(mine, rows.contiguous(), group=self.group)
        return mine


_DEFAULT = ExpertParallelGroup()
_ep_group = _DEFAULT


def get_ep_group() -> ExpertParallelGroup:
    """This process's expert-parallel group (the size-1 default unless initialised)."""
    return _ep_group


def init_expert_parallel(tensor_parallel_size: int = 1) -> ExpertParallelGroup:
    """Cut the initialised world into expert-parallel groups: the ranks of equal tensor rank,
    one from each replica of `tensor_parallel_size` consecutive ranks (the whole world when that
    is 1). Every process must call this, with the same size.

    Returns:
        This process's group, now also `get_ep_group()`.
    """
    global _ep_group
    if not dist.is_initialized():
        raise RuntimeError("init_expert_parallel needs torch.distributed.init_process_group "
                           "first (nccl on CUDA, gloo on CPU)")
    world_size, world_rank = dist.get_world_size(), dist.get_rank()
    if tensor_parallel_size < 1 or world_size % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} does not divide the "
                         f"world size {world_size}")
    size = world_size // tensor_parallel_size
    if size == 1:
        group = None
    elif tensor_parallel_size == 1:
        group = dist.group.WORLD
    else:
        group = None
        for tensor_rank in range(tensor_parallel_size):  # every rank creates every group
            ranks = list(range(tensor_rank, world_size, tensor_parallel_size))
            created = dist.new_group(ranks)
            if world_rank in ranks:
                group = created
    _ep_group = ExpertParallelGroup(rank=world_rank // tensor_parallel_size, size=size,
                                    group=group)
    return _ep_group


def destroy_expert_parallel() -> None:
    """Return to the size-1 default (the process groups stay the caller's to destroy)."""
    global _ep_group
    _ep_group = _DEFAULT
