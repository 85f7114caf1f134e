"""The expert-parallel group: data-parallel attention replicas whose MoE layers share experts.

With `--data-parallel-size N --enable-expert-parallel` each of the N ranks runs its own
attention replica over its own requests (its own latent cache, no replication) and owns
n_routed_experts / N of every MoE layer's routed experts (rank r: experts r * E / N onward).
Tokens meet their experts through the group's all-to-all collectives (`expert_parallel_moe`
in model/expert_parallel.py): one exchange of pair counts, the dispatch of token rows and
expert ids, and the combine of expert outputs. A rank with no tokens in a step still joins every
exchange with empty sends. The shared experts and the router are replicated.

Expert parallelism here spans the whole world with tensor-parallel size 1 inside each replica.
Without `init_expert_parallel` the group is the single-process default (rank 0 of 1), whose
model holds every expert and never communicates.
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


def init_expert_parallel() -> ExpertParallelGroup:
    """Make the whole initialised world one expert-parallel group (data parallel with expert
    parallel, tensor-parallel size 1 per replica); every process must call it.

    Returns:
        This process's group, now also `get_ep_group()`.
    """
    global _ep_group
    if not dist.is_initialized():
        raise RuntimeError("init_expert_parallel needs torch.distributed.init_process_group "
                           "first (nccl on CUDA, gloo on CPU)")
    size = dist.get_world_size()
    _ep_group = ExpertParallelGroup(rank=dist.get_rank(), size=size,
                                    group=dist.group.WORLD if size > 1 else None)
    return _ep_group


def destroy_expert_parallel() -> None:
    """Return to the size-1 default (the process groups stay the caller's to destroy)."""
    global _ep_group
    _ep_group = _DEFAULT
