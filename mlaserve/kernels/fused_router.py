"""DeepSeek's expert selection (the MoE router after its logits GEMM) as one Triton kernel.

One program per token holds the token's E router logits as a [n_group, E / n_group] tile,
padded to powers of two with lanes that can never be chosen, and does in registers what
`mlaserve.kernels.moe.select_experts_torch` does in about eight launches:
1. scores = softmax(logits) or sigmoid(logits); choice = scores (+ e_score_correction_bias).
2. grouped routing: each group's score is its best choice (V2, group_limited_greedy) or the sum
   of its two best (V3, noaux_tc, with a bias); `topk_group` rounds of argmax-and-mask keep the
   best groups, and the other groups' choices become 0.0 (V2) or -inf (V3), as in the torch code.
3. `top_k` rounds of argmax-and-mask over the choices pick the experts in descending order of
   their choice score (torch.topk's order); ties go to the lowest expert index, so the result
   is deterministic. Each chosen expert's weight is its unbiased score.
4. weights / (sum + 1e-20) if norm_topk_prob (and top_k > 1), times routed_scaling_factor.
5. with shared experts folded into the expert stacks, their ids E .. E + S - 1 follow the K
   picks with weight 1.0, so the MoE kernels run them with the routed experts.

The launch is fixed by host-side shapes (no host sync), so it can be captured in a CUDA graph;
the token count is the grid only, so one compiled kernel serves every batch size. On CPU tensors
the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, for tests).
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.interpreter import prepare_launch
from mlaserve.kernels.moe_common import ExpertChoice

# larger than any expert or group index: "no lane" in the min-index reductions
_NO_INDEX = tl.constexpr(1 << 30)


@triton.jit
def _select_experts_kernel(
    logits_ptr,  # [T, E] float32
    bias_ptr,  # [E] e_score_correction_bias (read only if HAS_BIAS)
    weights_ptr,  # [T, TOP_K + NUM_SHARED] float32 out
    ids_ptr,  # [T, TOP_K + NUM_SHARED] int64 out
    stride_logits,
    routed_scaling_factor,
    NUM_GROUPS: tl.constexpr,  # 1 for greedy routing
    GROUP_SIZE: tl.constexpr,  # E / NUM_GROUPS
    GROUPS_PAD: tl.constexpr,
    GROUP_SIZE_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr,  # else sigmoid
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    NORMALIZE: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    SHARED_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, GROUPS_PAD)  # [G]
    lane = tl.arange(0, GROUP_SIZE_PAD)  # [S]
    expert = group[:, None] * GROUP_SIZE + lane[None, :]  # [G, S] expert index of each lane
    valid = (group < NUM_GROUPS)[:, None] & (lane < GROUP_SIZE)[None, :]  # [G, S]
    neg_inf = float("-inf")

    logits = tl.load(logits_ptr + token * stride_logits + expert, mask=valid, other=neg_inf)
    logits = logits.to(tl.float32)
    if SOFTMAX:
        row_max = tl.max(tl.max(logits, axis=1), axis=0)
        exp = tl.exp(logits - row_max)  # padded lanes: exp(-inf) = 0
        scores = exp / tl.sum(tl.sum(exp, axis=1), axis=0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        choice = scores + bias
    # NaN ranks above everything, as in torch.topk (and the min-index picks stay valid lanes)
    choice = tl.where(choice != choice, float("inf"), choice)

    if GROUPED:
        # group scores [G]: the best choice, or with a bias the sum of the two best
        in_group = tl.where(valid, choice, neg_inf)
        best = tl.max(in_group, axis=1)
        if HAS_BIAS:
            first = tl.min(tl.where(valid & (in_group == best[:, None]), lane[None, :],
                                    _NO_INDEX), axis=1)
            second = tl.max(tl.where(lane[None, :] == first[:, None], neg_inf, in_group), axis=1)
            group_scores = best + second
        else:
            group_scores = best
        group_open = group < NUM_GROUPS
        group_kept = group < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(tl.where(group_open, group_scores, neg_inf), axis=0)
            pick = tl.min(tl.where(group_open & (group_scores == top), group, _NO_INDEX), axis=0)
            group_kept = group_kept | (group == pick)
            group_open = group_open & (group != pick)
        if HAS_BIAS:
            choice = tl.where(group_kept[:, None], choice, neg_inf)
        else:
            choice = tl.where(group_kept[:, None], choice, 0.0)

    # top_k rounds of argmax-and-mask; `choosable` tracks the lanes still choosable (a chosen lane,
    # and a padded one, is never choosable even when the best remaining choice is -inf)
    slot = tl.arange(0, TOP_K_PAD)
    topk_weights = tl.zeros([TOP_K_PAD], dtype=tl.float32)
    topk_ids = tl.zeros([TOP_K_PAD], dtype=tl.int32)
    choosable = valid
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(tl.where(choosable, choice, neg_inf), axis=1), axis=0)
        candidates = tl.where(choosable & (choice == top), expert, _NO_INDEX)
        pick = tl.min(tl.min(candidates, axis=1), axis=0)
        chosen = expert == pick
        weight = tl.sum(tl.sum(tl.where(chosen, scores, 0.0), axis=1), axis=0)
        topk_weights = tl.where(slot == k, weight, topk_weights)
        topk_ids = tl.where(slot == k, pick, topk_ids)
        choosable = choosable & ~chosen

    if NORMALIZE:
        topk_weights = topk_weights / (tl.sum(topk_weights, axis=0) + 1e-20)
    topk_weights = topk_weights * routed_scaling_factor
    out_mask = slot < TOP_K
    row = token * (TOP_K + NUM_SHARED)
    tl.store(weights_ptr + row + slot, topk_weights, mask=out_mask)
    tl.store(ids_ptr + row + slot, topk_ids.to(tl.int64), mask=out_mask)
    if NUM_SHARED > 0:
        shared = tl.arange(0, SHARED_PAD)
        shared_mask = shared < NUM_SHARED
        tl.store(weights_ptr + row + TOP_K + shared, tl.full([SHARED_PAD], 1.0, tl.float32),
                 mask=shared_mask)
        tl.store(ids_ptr + row + TOP_K + shared,
                 (NUM_GROUPS * GROUP_SIZE + shared).to(tl.int64), mask=shared_mask)


def select_experts_triton(
    router_logits: torch.Tensor,
    choice: ExpertChoice,
    e_score_correction_bias: torch.Tensor | None = None,
    num_shared_experts: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts per token in one launch; the contract of `moe.select_experts`.

    Args:
        router_logits: [T, E] float32 (any row stride, unit column stride).
        choice: the routing rule (top_k, groups, scoring, weights).
        e_score_correction_bias: [E] added to the scores for the choice only (V3), or None.
        num_shared_experts: S always-chosen experts appended after the K picks, with ids
            E .. E + S - 1 and weight 1.0.

    Returns:
        topk_weights [T, K + S] float32 and topk_ids [T, K + S] int64: the K picks in descending
        order of the choice score (ties: lowest expert index first), then the S shared experts.
    """
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits: expected [T, E] with unit column stride, got shape "
                         f"{tuple(router_logits.shape)} strides {router_logits.stride()}")
    num_tokens, num_experts = router_logits.shape
    top_k, n_group, topk_group = choice.top_k, choice.n_group, choice.topk_group
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}]")
    grouped = choice.use_grouped_topk and n_group > 1
    num_groups = n_group if grouped else 1
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} groups")
    if grouped and not 0 < topk_group <= num_groups:
        raise ValueError(f"topk_group {topk_group} must be in [1, {num_groups}]")
    group_size = num_experts // num_groups
    if e_score_correction_bias is not None:
        if e_score_correction_bias.shape != (num_experts,):
            raise ValueError(f"e_score_correction_bias: expected [{num_experts}], got "
                             f"{tuple(e_score_correction_bias.shape)}")
        e_score_correction_bias = e_score_correction_bias.contiguous()
        if grouped and group_size < 2:
            raise ValueError("groups of one expert have no two best scores")

    device = router_logits.device
    width = top_k + num_shared_experts
    topk_weights = torch.empty(num_tokens, width, dtype=torch.float32, device=device)
    topk_ids = torch.empty(num_tokens, width, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return topk_weights, topk_ids
    prepare_launch(router_logits)
    groups_pad = triton.next_power_of_2(num_groups)
    group_size_pad = triton.next_power_of_2(group_size)
    bias = router_logits if e_score_correction_bias is None else e_score_correction_bias
    _select_experts_kernel[(num_tokens,)](
        router_logits, bias, topk_weights, topk_ids,
        router_logits.stride(0), float(choice.routed_scaling_factor),
        NUM_GROUPS=num_groups, GROUP_SIZE=group_size, GROUPS_PAD=groups_pad,
        GROUP_SIZE_PAD=group_size_pad, TOPK_GROUP=topk_group if grouped else 1, TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k), SOFTMAX=choice.scoring_func == "softmax",
        HAS_BIAS=e_score_correction_bias is not None, GROUPED=grouped,
        NORMALIZE=choice.norm_topk_prob and top_k > 1, NUM_SHARED=num_shared_experts,
        SHARED_PAD=triton.next_power_of_2(max(num_shared_experts, 1)),
        num_warps=1 if groups_pad * group_size_pad <= 256 else 4)
    return topk_weights, topk_ids
