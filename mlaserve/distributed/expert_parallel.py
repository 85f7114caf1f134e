"""The expert-parallel group: data-parallel attention replicas whose MoE layers share experts.

With `--data-parallel-size N --enable-expert-parallel` each of the N ranks runs its own
attention replica over its own requests (its own latent cache, no replication) and owns
n_routed_experts / N of every MoE layer's routed experts (rank r: experts r * E / N onward).
Tokens meet their experts through the group's all-to-all collectives (`expert_parallel_moe`
in model/expert_parallel.py): one exchange of pair counts, the dispatch of token rows and
expert ids, and the combine of expert outputs. A rank with no tokens in a step still joins every
exchange with empty sends. The shared experts and the router are replicated.

With tensor parallelism inside each replica (`-tp T -dp N`, world rank = replica * T + tensor
rank) the expert-parallel groups are the ranks of equal tensor rank, one per replica: rank t of
every replica holds the tensor shard t (moe_intermediate_size / T columns) of the same E / N
experts, so the pairs travel between equal shards and each replica all-reduces the partial sums
as a tensor-parallel MoE does. Without `init_expert_parallel` the group is the single-process
default (rank 0 of 1), whose model holds every expert and never communicates.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExpertParallelGroup:
    """The ranks the routed experts are split across.

    rank: this process's index, 0 .. size - 1; it owns experts rank * E / size onward.
    size: the number of ranks (the data-parallel size).
    group: their torch.distributed group; None when size is 1.
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        """Tell every rank how many rows this rank sends it; learn what each sends here.

        Args:
            send_counts: [size] int64, rows for rank r at index r.

        Returns:
            [size] ints on the host (a device sync on CUDA): rows rank r sends here.
        """
        received = torch.empty_like(send_counts)
        dist.all_to_all_single(received, send_counts.contiguous(), group=self.group)
        return received.tolist()

    def all_to_all(self, rows: torch.Tensor, send_splits: list[int],
                   recv_splits: list[int]) -> torch.Tensor:
        """Send consecutive runs of rows to the ranks in order; receive theirs.

        Args:
            rows: [sum(send_splits), ...], the run for rank r after the runs for ranks < r.
            send_splits, recv_splits: rows sent to / received from each rank.

        Returns:
            [sum(recv_splits), ...] in rank order.
        """
        received = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), recv_splits, send_splits,
                               group=self.group)
        return received


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
