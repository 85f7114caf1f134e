"""What the MoE kernels share (moe.py's torch and dispatch code, fused_moe.py's and
fused_router.py's Triton kernels): the routing rule and the check of block-FP8 expert stacks.
Kernels import this, never their dispatcher (`moe.select_experts`, `moe.fused_experts`)."""

from dataclasses import dataclass

import torch

from mlaserve.kernels.fp8_blocks import BLOCK_SIZE, FP8_DTYPE


@dataclass(frozen=True)
class ExpertChoice:
    """DeepSeek's routing rule (the module docstring states it), in the HF config's names."""

    top_k: int  # experts per token (num_experts_per_tok), K <= E
    scoring_func: str  # "softmax" (V2) or "sigmoid" (V3)
    # with use_grouped_topk and n_group > 1, the choice is restricted to the best topk_group
    # of n_group equal groups of experts (E % n_group == 0)
    n_group: int
    topk_group: int
    norm_topk_prob: bool  # renormalise the K weights to sum to 1 (when K > 1)
    routed_scaling_factor: float  # multiplies the weights
    use_grouped_topk: bool  # group-limited routing (topk_method other than "greedy")

    def __post_init__(self) -> None:
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown scoring function {self.scoring_func!r} (softmax or "
                             "sigmoid)")


def check_fp8_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                      gate_up_scale_inv: torch.Tensor | None,
                      down_scale_inv: torch.Tensor | None) -> bool:
    """Whether the expert stacks are block FP8; raises ValueError where their scales are
    missing, or where weights or scales do not have the shapes and dtypes `fused_experts` states.
    """
    fp8_weights = {gate_up_proj.dtype, down_proj.dtype} & {FP8_DTYPE}
    if gate_up_scale_inv is None and down_scale_inv is None and not fp8_weights:
        return False
    if gate_up_scale_inv is None or down_scale_inv is None:
        raise ValueError("FP8 experts need both gate_up_scale_inv and down_scale_inv")
    if gate_up_proj.dtype != FP8_DTYPE or down_proj.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 experts need float8_e4m3fn gate_up_proj and down_proj, not "
                         f"{gate_up_proj.dtype} and {down_proj.dtype}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"expert stacks are [E, 2I, D] and [E, D, I], not "
                         f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    num_experts, two_inter, hidden = gate_up_proj.shape
    inter = two_inter // 2
    if x.shape[-1] != hidden or tuple(down_proj.shape) != (num_experts, hidden, inter):
        raise ValueError(f"x {tuple(x.shape)}, gate_up_proj {tuple(gate_up_proj.shape)} and "
                         f"down_proj {tuple(down_proj.shape)} are not [T, D], [E, 2I, D], "
                         f"[E, D, I]")
    block_n, block_k = BLOCK_SIZE
    if inter % block_n or two_inter != 2 * inter:
        raise ValueError(f"FP8 experts need I = {inter} a multiple of {block_n}, so that the up "
                         f"rows start at a scale block")
    for name, scale, (rows, cols) in (("gate_up_scale_inv", gate_up_scale_inv, (two_inter, hidden)),
                                      ("down_scale_inv", down_scale_inv, (hidden, inter))):
        want = (num_experts, -(-rows // block_n), -(-cols // block_k))
        if scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise ValueError(f"{name} is {scale.dtype} {tuple(scale.shape)}, not float32 {want} "
                             f"(one scale per expert and {block_n}x{block_k} block)")
    return True
