"""Routed experts across the ranks of the expert-parallel group: dispatch, compute, combine.

Each (token, k) pair goes to the rank that owns its expert. Pairs are sorted by owner and each
rank's run of token rows and local expert ids is sent to it (all-to-all, after one exchange of
the run lengths). Every rank runs its experts over the rows it received, as a fused MoE with one
expert per row and weight 1, and sends the outputs back the same way. The sender weights each
returned row by its routing weight and sums a token's K rows in float32. A rank with no tokens
sends and receives empty runs, so every rank joins every exchange.
"""

import torch

from mlaserve.distributed.expert_parallel import ExpertParallelGroup
from mlaserve.kernels.moe import fused_experts


def expert_parallel_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                        ep: ExpertParallelGroup, gate_up_scale_inv: torch.Tensor | None = None,
                        down_scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w_k * expert_{ids_k}(x) with the routed experts split over the group's ranks.

    Args:
        x: [T, D] this rank's tokens (T may be 0).
        topk_weights: [T, K] float32; topk_ids: [T, K] int64 global routed expert ids.
        gate_up_proj: [E_local, 2I, D] and down_proj: [E_local, D, I], this rank's experts
            (global ids rank * E_local onward).
        gate_up_scale_inv, down_scale_inv: their block scales where they are FP8
            (`fused_experts`).

    Returns:
        [T, D] in x's dtype.
    """
    num_tokens, top_k = topk_ids.shape
    hidden, num_local = x.shape[1], gate_up_proj.shape[0]
    flat_ids = topk_ids.flatten()  # [T * K]
    owner = flat_ids // num_local  # [T * K]
    order = torch.argsort(owner, stable=True)  # pairs grouped by owner, in pair order
    token_of = order // top_k  # [T * K] source token of each sorted pair
    send_counts = torch.bincount(owner, minlength=ep.size)  # [size]
    recv_splits = ep.exchange_counts(send_counts)
    send_splits = send_counts.tolist()
    rows = ep.all_to_all(x[token_of], send_splits, recv_splits)  # [R, D]
    local_ids = ep.all_to_all((flat_ids - owner * num_local)[order], send_splits, recv_splits)
    if rows.shape[0]:
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        outputs = fused_experts(rows, gate_up_proj, down_proj, ones, local_ids[:, None],
                                gate_up_scale_inv=gate_up_scale_inv,
                                down_scale_inv=down_scale_inv)
    else:
        outputs = rows  # [0, D]
    returned = ep.all_to_all(outputs, recv_splits, send_splits)  # [T * K, D] in `order`
    weighted = returned.float() * topk_weights.flatten()[order][:, None]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of, weighted).to(x.dtype)
