"""Mixture-of-experts routing and expert computation.

Routing follows DeepSeek: V2 scores with a softmax and picks the top-k greedily or within the
best `topk_group` of `n_group` groups (group score = its best expert); V3 scores with a sigmoid,
adds `e_score_correction_bias` for the choice only, and ranks groups by the sum of their two best
biased scores. Weights are the unbiased scores of the chosen experts, renormalised if
`norm_topk_prob`, times `routed_scaling_factor`. `select_experts` runs this as one Triton launch
(`fused_router`) where `fused.use_fused_kernels` says the fused kernels run (CUDA
tensors), else as the torch code of `select_experts_torch`, which states the semantics.

The experts run as the Triton kernels of `fused_moe` on CUDA, as grouped GEMMs on CPU (and bf16
CUDA without Triton), or as a per-expert loop, which in float32 is the reference. Expert stacks
may also be DeepSeek's block FP8 (`fp8_blocks.py`, per expert): the Triton kernels run them w8a8,
the other implementations dequantize them to float32 (weight-only).
"""

import functools
import importlib.util

import torch
import torch.nn.functional as F

from mlaserve.kernels.fp8_blocks import (
    ACTIVATION_BLOCK,
    FP8_DTYPE,
    QuantizedActivations,
    dequantize_block_fp8,
    quantize_block_fp8,
)
from mlaserve.kernels.fused import use_fused_kernels
from mlaserve.kernels.moe_common import ExpertChoice, check_fp8_experts


def select_experts(
    router_logits: torch.Tensor,
    choice: ExpertChoice,
    e_score_correction_bias: torch.Tensor | None = None,
    num_shared_experts: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts per token.

    Args:
        router_logits: [T, E] float32.
        choice: the routing rule.
        e_score_correction_bias: [E] added to the scores for the choice only (V3), or None.
        num_shared_experts: S shared experts folded into the expert stacks after the E routed
            ones: every token also takes experts E .. E + S - 1, with weight 1.0.

    Returns:
        topk_weights [T, K + S] float32 and topk_ids [T, K + S] int64: the K routed picks in
        descending order of the choice score, then the shared experts.
    """
    if use_fused_kernels(router_logits):
        from mlaserve.kernels.fused_router import select_experts_triton  # imports triton

        select = select_experts_triton
    else:
        select = select_experts_torch
    return select(router_logits, choice, e_score_correction_bias, num_shared_experts)


def select_experts_torch(
    router_logits: torch.Tensor,
    choice: ExpertChoice,
    e_score_correction_bias: torch.Tensor | None = None,
    num_shared_experts: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` in torch ops (about eight launches): the CPU path and the semantics."""
    num_tokens, num_experts = router_logits.shape
    top_k, n_group, topk_group = choice.top_k, choice.n_group, choice.topk_group
    if choice.scoring_func == "softmax":
        scores = router_logits.softmax(dim=-1)
    else:
        scores = router_logits.sigmoid()
    ranked = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    if choice.use_grouped_topk and n_group > 1:
        grouped = ranked.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
        if e_score_correction_bias is None:
            group_scores = grouped.max(dim=-1).values  # [T, G]
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        group_idx = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, group_idx, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        fill = 0.0 if e_score_correction_bias is None else float("-inf")
        ranked = ranked.masked_fill(~expert_mask, fill)
    topk_ids = ranked.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if choice.norm_topk_prob and top_k > 1:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * choice.routed_scaling_factor
    if num_shared_experts:
        shared = torch.arange(num_experts, num_experts + num_shared_experts,
                              device=topk_ids.device).expand(num_tokens, -1)  # [T, S]
        topk_ids = torch.cat((topk_ids, shared), dim=1)
        topk_weights = torch.cat((topk_weights, torch.ones_like(shared, dtype=torch.float32)), 1)
    return topk_weights, topk_ids


def _sort_by_expert(topk_ids: torch.Tensor, num_experts: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] (-1: unrouted) -> flat expert ids [T * K] with unrouted pairs as
    num_experts, the order sorting them by expert (stable; unrouted pairs last) [T * K], and the
    source token of each sorted (token, k) pair [T * K]."""
    flat_ids = topk_ids.flatten()  # [T * K]
    flat_ids = torch.where(flat_ids < 0, num_experts, flat_ids)
    order = flat_ids.argsort(stable=True)
    return flat_ids, order, order // topk_ids.shape[1]


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def moe_graph_capturable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fused_experts` (impl "auto") runs without a host sync, so CUDA graphs can capture
    it: on CPU, on CUDA with Triton (any dtype), and on CUDA in bf16 through grouped GEMMs.
    dtype: the expert weights' (float8_e4m3fn for FP8 experts, which grouped GEMMs do not run)."""
    return device.type != "cuda" or _triton_available() or dtype == torch.bfloat16


def runs_w8a8(x: torch.Tensor, gate_up_proj: torch.Tensor) -> bool:
    """Whether `fused_experts(impl="auto")` runs these experts w8a8 (block-FP8 weights through
    Triton on CUDA), reading x quantized: then its producer may quantize x for it."""
    return (x.device.type == "cuda" and gate_up_proj.dtype == FP8_DTYPE
            and _triton_available())


def fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    impl: str = "auto",
    shared_experts: int = 0,
    gate_up_scale_inv: torch.Tensor | None = None,
    down_scale_inv: torch.Tensor | None = None,
    has_unrouted: bool = False,
    x_quantized: QuantizedActivations | None = None,
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's chosen experts e = ids_k.

    Args:
        x: [T, D] hidden states.
        gate_up_proj: [E, 2 * I, D] (gate rows then up rows), x's dtype or float8_e4m3fn.
        down_proj: [E, D, I], like gate_up_proj.
        topk_weights: [T, K] float32; topk_ids: [T, K] int64.
        impl: "triton" (`fused_moe.fused_experts_triton`), "grouped" (two `torch._grouped_mm`
            calls; CPU, or bf16 on CUDA), "loop" (`fused_experts_loop`, one host sync), or
            "auto": Triton on CUDA when it is installed, else grouped where it runs, else loop.
        shared_experts: how many of the stacks' last experts every token takes (shared experts
            folded in; the last columns of topk_ids). Only the Triton tile choice reads it.
        gate_up_scale_inv: [E, 2I / 128, ceil(D / 128)] float32 and down_scale_inv
            [E, ceil(D / 128), I / 128] float32, given with FP8 weights: DeepSeek's scale per
            128x128 block of each expert's weight (`fp8_blocks.py`); I is a multiple of 128, so
            the up rows start at a block. "triton" runs them w8a8 (x and the activation
            quantized per token and 128 columns); the other impls dequantize the weights and
            compute in float32.
        has_unrouted: some ids are -1, pairs that add nothing (expert parallelism gives each
            rank every token, with -1 for the experts other ranks hold). Only "triton" needs to
            be told (it then zeroes the pairs' outputs before writing the routed ones).
        x_quantized: x quantized by its producer (`runs_w8a8` says when to ask for it), which
            the w8a8 path reads instead of quantizing x; the other paths read x.

    Returns:
        [T, D] in x's dtype.
    """
    if impl == "auto":
        if x.device.type == "cuda" and _triton_available():
            impl = "triton"
        else:
            impl = "grouped" if moe_graph_capturable(x.device, gate_up_proj.dtype) else "loop"
    if impl == "triton":
        from mlaserve.kernels.fused_moe import fused_experts_triton  # imports triton

        return fused_experts_triton(x, gate_up_proj, down_proj, topk_weights, topk_ids,
                                    shared_experts=shared_experts,
                                    gate_up_scale_inv=gate_up_scale_inv,
                                    down_scale_inv=down_scale_inv,
                                    has_unrouted=has_unrouted,
                                    x_quantized=x_quantized)  # checks its inputs
    fp8 = check_fp8_experts(x, gate_up_proj, down_proj, gate_up_scale_inv, down_scale_inv)
    if fp8 and impl in ("grouped", "loop"):  # weight-only: dequantize, compute in float32
        gate_up_proj = dequantize_block_fp8(gate_up_proj, gate_up_scale_inv)  # [E, 2I, D]
        down_proj = dequantize_block_fp8(down_proj, down_scale_inv)  # [E, D, I]
        return fused_experts(x.float(), gate_up_proj, down_proj, topk_weights, topk_ids,
                             impl=impl).to(x.dtype)
    if impl == "grouped":
        return fused_experts_grouped(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    if impl == "loop":
        return fused_experts_loop(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    raise ValueError(f"unknown MoE implementation {impl!r}")


def fused_experts_grouped(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Grouped GEMMs, same contract as `fused_experts`.

    The (token, expert) pairs are sorted by expert and run as two grouped GEMMs
    (`torch._grouped_mm`): no host sync, a fixed number of launches. CUDA's grouped GEMM takes
    bf16 only.
    """
    num_tokens, num_experts = topk_ids.shape[0], gate_up_proj.shape[0]
    flat_ids, order, token_of = _sort_by_expert(topk_ids, num_experts)
    experts = torch.arange(num_experts, device=x.device, dtype=flat_ids.dtype)
    # [E] end of each expert's rows; searchsorted, unlike bincount on CUDA, never syncs. Rows
    # past the last end (unrouted pairs) belong to no group: their products are not defined.
    sorted_ids = flat_ids[order]
    offsets = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    h = torch._grouped_mm(x[token_of], gate_up_proj.transpose(1, 2), offs=offsets)  # [T*K, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(1, 2), offs=offsets)
    y = y.float() * topk_weights.flatten()[order][:, None]  # [T * K, D]
    y = torch.where((sorted_ids < num_experts)[:, None], y, 0.0)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of, y).to(x.dtype)


def fused_experts_loop(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The per-expert loop, same contract as `fused_experts`; also the float32 reference.

    Loops over the experts that received tokens: one host sync, one GEMM pair per expert. With
    compute_dtype (torch.float32 for the reference: full-precision matmuls, so TF32 must be off,
    torch's default) each expert's rows and weights are cast to it as the loop reaches that
    expert, and the result is returned in compute_dtype.
    """
    dtype = compute_dtype or x.dtype
    num_tokens, num_experts = topk_ids.shape[0], gate_up_proj.shape[0]
    flat_ids, order, token_of = _sort_by_expert(topk_ids, num_experts)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()[:num_experts]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        tokens = token_of[start : start + count]
        start += count
        gate, up = F.linear(x[tokens].to(dtype), gate_up_proj[expert].to(dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[expert].to(dtype))  # [count, D]
        weights = topk_weights.flatten()[pairs][:, None]
        out.index_add_(0, tokens, (y * weights).float())
    return out.to(dtype)


def fused_experts_w8a8_reference(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_scale_inv: torch.Tensor,
    down_scale_inv: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """What the Triton kernels compute for block-FP8 experts (w8a8), in compute_dtype from the
    dequantized operands: x quantized per token and 128 columns, each expert's weights
    dequantized as it is reached, the activation silu(gate) * up rounded to x's dtype and
    quantized like x, the pairs' outputs weighted and summed. Same arguments as
    `fused_experts`; one host sync, one expert at a time. Returns [T, D] in compute_dtype."""
    def dequantized_rows(rows: torch.Tensor) -> torch.Tensor:  # [M, N] -> [M, N] float32
        values, scales = quantize_block_fp8(rows, ACTIVATION_BLOCK)
        return dequantize_block_fp8(values, scales, block_size=ACTIVATION_BLOCK)

    x_deq = dequantized_rows(x).to(compute_dtype)  # [T, D]
    out = torch.zeros(x.shape, dtype=compute_dtype, device=x.device)
    for expert in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)  # [P] pairs of the expert
        gate_up = dequantize_block_fp8(gate_up_proj[expert], gate_up_scale_inv[expert])
        gate, up = (x_deq[tokens] @ gate_up.to(compute_dtype).T).chunk(2, dim=-1)  # [P, I]
        act = dequantized_rows((F.silu(gate) * up).to(x.dtype)).to(compute_dtype)  # [P, I]
        down = dequantize_block_fp8(down_proj[expert], down_scale_inv[expert])  # [D, I]
        weights = topk_weights[tokens, slots].to(compute_dtype)[:, None]  # [P, 1]
        out.index_add_(0, tokens, weights * (act @ down.to(compute_dtype).T))
    return out


# dtype -> (relative Frobenius error, 1 - least per-row cosine similarity) that `fused_experts`
# in that dtype may show against the float32 reference. bf16 rounds with a relative error of
# about 1.6e-3 rms; the Triton path rounds three times (activation, each pair's output, the
# sum), the grouped path about six (gate, up, silu, product, down output, sum), ~4e-3 in all,
# so 1 - cos ~ 4e-3^2 / 2 ~ 1e-5: the bounds leave a factor of 2.5 (error) and 5 (cosine).
# float16 has 8x finer rounding; float32 errors are summation order only.
REFERENCE_TOLERANCES = {
    torch.bfloat16: (1e-2, 5e-5),
    torch.float16: (2e-3, 2e-6),
    torch.float32: (1e-5, 1e-9),
}
# The same for the Triton kernels on a GPU with block-FP8 experts against
# `fused_experts_w8a8_reference`: Hopper sums an FP8 product of one 128-deep K block with ~14-bit
# precision, so an activation element may round to a neighbouring FP8 value on one side only;
# activations perturbed by 1e-4 move the output by up to 3e-3 (1.5e-5 in cosine).
W8A8_REFERENCE_TOLERANCES = (1e-2, 1e-4)


def reference_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||out - ref|| / ||ref||, 1 - least per-row cosine similarity), computed in float64 over
    the rows where ref is not zero; both inf if out has a NaN or inf.

    Args:
        out: [T, D] any float dtype; ref: [T, D] float32 (`fused_experts_loop` in float32).
    """
    if not torch.isfinite(out).all():
        return float("inf"), float("inf")
    out, ref = out.double(), ref.double()
    rel_err = ((out - ref).norm() / ref.norm()).item()
    rows = ref.norm(dim=-1) > 0  # [T]
    cosine = F.cosine_similarity(out[rows], ref[rows], dim=-1)  # [rows with output]
    return rel_err, (1 - cosine.min()).item()
