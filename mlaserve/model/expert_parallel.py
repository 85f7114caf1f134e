"""Routed experts across the ranks of the expert-parallel group: dispatch, compute, combine.

Every rank's MoE layer exchanges a fixed number of rows per rank, the step's `capacity` C (agreed
by every replica before the step, `Lockstep.agree_capacity`; a CUDA graph of C rows has it as
its batch size): this rank's T <= C tokens, then padding rows. Each row carries its token's
routing (K weights and K global expert ids, -1 on padding rows, packed after the hidden row in
its dtype), so one all-gather (`ExpertParallelGroup.dispatch`) gives every rank all S * C rows:
each token's row goes once to every rank, whatever its routing. Each rank runs one fused MoE
over the S * C rows with its own experts only (ids of other ranks' experts become -1, unrouted)
plus the shared experts on its own tokens, and one reduce-scatter
(`ExpertParallelGroup.combine`) sums the S partial outputs of every token on the token's rank.

Nothing is read on the host and every shape follows from C, so the exchange runs inside CUDA
graphs. Steps larger than `EXCHANGE_CHUNK` rows per rank (prefills) run in chunks of that many,
which bounds the gathered buffers ([S * chunk, D] and the fused MoE's [S * chunk * K] pairs);
the chunk count follows from C, the same on every rank.
"""

import torch

from mlaserve.distributed.expert_parallel import ExpertParallelGroup
from mlaserve.kernels.moe import fused_experts

EXCHANGE_CHUNK = 512  # rows per rank in one dispatch/combine


def expert_parallel_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                        ep: ExpertParallelGroup, capacity: int | None = None,
                        num_shared: int = 0, gate_up_scale_inv: torch.Tensor | None = None,
                        down_scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w_k * expert_{ids_k}(x) + sum of the shared experts(x), with the routed experts
    split over the group's ranks.

    Args:
        x: [T, D] this rank's tokens (T may be 0).
        topk_weights: [T, K] float32; topk_ids: [T, K] int64 global routed expert ids.
        gate_up_proj: [E_local + S, 2I, D] and down_proj: [E_local + S, D, I]: this rank's
            routed experts (global ids rank * E_local onward), then the S = num_shared shared
            experts.
        capacity: C >= T, the rows every rank exchanges (the same on every rank); None: T.
        gate_up_scale_inv, down_scale_inv: their block scales where they are FP8
            (`fused_experts`).

    Returns:
        [T, D] in x's dtype.
    """
    num_tokens = x.shape[0]
    capacity = num_tokens if capacity is None else capacity
    if capacity < num_tokens:
        raise ValueError(f"expert-parallel capacity {capacity} is below the step's "
                         f"{num_tokens} tokens")
    outputs = []
    for start in range(0, capacity, EXCHANGE_CHUNK):
        rows = min(EXCHANGE_CHUNK, capacity - start)
        end = min(start + rows, num_tokens)
        outputs.append(_exchange(x[start:end], topk_weights[start:end], topk_ids[start:end],
                                 rows, gate_up_proj, down_proj, ep, num_shared,
                                 gate_up_scale_inv, down_scale_inv))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def _exchange(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, rows: int,
              gate_up_proj: torch.Tensor, down_proj: torch.Tensor, ep: ExpertParallelGroup,
              num_shared: int, gate_up_scale_inv: torch.Tensor | None,
              down_scale_inv: torch.Tensor | None) -> torch.Tensor:
    """One dispatch, fused MoE and combine of `rows` rows per rank, this rank's n <= rows
    tokens first: x [n, D], topk_weights / topk_ids [n, K] -> [n, D]."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_local = gate_up_proj.shape[0] - num_shared
    # [rows, D + routing]: the hidden row, then K weights and K ids as float32 in its bytes
    routing = torch.full((rows, 2 * top_k), -1.0, dtype=torch.float32, device=x.device)
    routing[:num_tokens, :top_k] = topk_weights
    routing[:num_tokens, top_k:] = topk_ids.float()  # exact: ids < 2^24
    packed = torch.zeros(rows, hidden, dtype=x.dtype, device=x.device)
    packed[:num_tokens] = x
    packed = torch.cat((packed, routing.view(x.dtype)), dim=1)
    gathered = ep.dispatch(packed)  # [S * rows, D + routing]
    tokens = gathered[:, :hidden]
    routing = gathered[:, hidden:].contiguous().view(torch.float32)  # [S * rows, 2K]
    weights, ids = routing[:, :top_k], routing[:, top_k:].long()  # -1 on padding rows
    local = ids - ep.rank * num_local
    local = torch.where((ids >= 0) & (local >= 0) & (local < num_local), local, -1)
    if num_shared:  # this rank's own tokens take the shared experts, weight 1
        own = torch.zeros(gathered.shape[0], dtype=torch.bool, device=x.device)
        own[ep.rank * rows : ep.rank * rows + num_tokens] = True
        shared = torch.arange(num_local, num_local + num_shared, device=x.device)
        local = torch.cat((local, torch.where(own[:, None], shared, -1)), dim=1)
        weights = torch.cat((weights, torch.ones(weights.shape[0], num_shared,
                                                 device=x.device)), dim=1)
    partial = fused_experts(tokens, gate_up_proj, down_proj, weights, local,
                            shared_experts=num_shared, gate_up_scale_inv=gate_up_scale_inv,
                            down_scale_inv=down_scale_inv, has_unrouted=True)  # [S * rows, D]
    return ep.combine(partial)[:num_tokens]
