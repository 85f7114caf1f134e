"""Mixture-of-experts routing and expert computation (torch implementation).

Routing follows DeepSeek: V2 scores with a softmax and picks the top-k greedily or within the
best `topk_group` of `n_group` groups (group score = its best expert); V3 scores with a sigmoid,
adds `e_score_correction_bias` for the choice only, and ranks groups by the sum of their two best
biased scores. Weights are the unbiased scores of the chosen experts, renormalised if
`norm_topk_prob`, times `routed_scaling_factor`.
"""

import torch
import torch.nn.functional as F


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    use_grouped_topk: bool,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts per token.

    Args:
        router_logits: [T, E] float32.
        use_grouped_topk: restrict the choice to the best `topk_group` groups.

    Returns:
        topk_weights [T, top_k] float32 and topk_ids [T, top_k] int64.
    """
    num_tokens, num_experts = router_logits.shape
    if scoring_func == "softmax":
        scores = router_logits.softmax(dim=-1)
    else:
        scores = router_logits.sigmoid()
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    if use_grouped_topk and n_group > 1:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
        if e_score_correction_bias is None:
            group_scores = grouped.max(dim=-1).values  # [T, G]
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        group_idx = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, group_idx, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        fill = 0.0 if e_score_correction_bias is None else float("-inf")
        choice = choice.masked_fill(~expert_mask, fill)
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob and top_k > 1:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


def _sort_by_expert(topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> flat ids [T * K], the order sorting them by expert (stable) [T * K],
    and the source token of each sorted (token, k) pair [T * K]."""
    flat_ids = topk_ids.flatten()  # [T * K]
    order = flat_ids.argsort(stable=True)
    return flat_ids, order, order // topk_ids.shape[1]


def grouped_gemm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fused_experts` runs as grouped GEMMs (no host sync, so CUDA graphs can capture
    it): on CPU, and on CUDA in bf16 (CUDA's grouped GEMM takes no other dtype)."""
    return device.type != "cuda" or dtype == torch.bfloat16


def fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's chosen experts e = ids_k.

    Args:
        x: [T, D] hidden states.
        gate_up_proj: [E, 2 * I, D] (gate rows then up rows).
        down_proj: [E, D, I].
        topk_weights: [T, K] float32; topk_ids: [T, K] int64.

    Returns:
        [T, D] in x's dtype. The (token, expert) pairs are sorted by expert and run as two
        grouped GEMMs (`torch._grouped_mm`): no host sync, a fixed number of launches. CUDA's
        grouped GEMM takes bf16 only; other CUDA dtypes loop over the experts.
    """
    if not grouped_gemm_supported(x.device, x.dtype):
        return fused_experts_loop(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    num_tokens = topk_ids.shape[0]
    flat_ids, order, token_of = _sort_by_expert(topk_ids)
    experts = torch.arange(gate_up_proj.shape[0], device=x.device, dtype=flat_ids.dtype)
    # [E] end of each expert's rows; searchsorted, unlike bincount on CUDA, never syncs
    offsets = torch.searchsorted(flat_ids[order], experts, right=True).to(torch.int32)
    h = torch._grouped_mm(x[token_of], gate_up_proj.transpose(1, 2), offs=offsets)  # [T*K, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(1, 2), offs=offsets)
    y = y.float() * topk_weights.flatten()[order][:, None]  # [T * K, D]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of, y).to(x.dtype)


def fused_experts_loop(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The per-expert loop, same contract as `fused_experts`.

    Loops over the experts that received tokens: one host sync, one GEMM pair per expert.
    """
    num_tokens = topk_ids.shape[0]
    flat_ids, order, token_of = _sort_by_expert(topk_ids)
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0]).tolist()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        tokens = token_of[start : start + count]
        start += count
        gate, up = F.linear(x[tokens], gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[expert])  # [count, D]
        weights = topk_weights.flatten()[pairs][:, None]
        out.index_add_(0, tokens, (y * weights).float())
    return out.to(x.dtype)
