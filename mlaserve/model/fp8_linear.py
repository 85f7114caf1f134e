"""Linear layers that keep DeepSeek's block-FP8 weights as the checkpoint stores them.

`keep_linears_fp8` turns the model's Linear layers (built on the meta device) into FP8 ones:
`weight` [out, in] becomes float8_e4m3fn and a float32 `weight_scale_inv`
[ceil(out / 128), ceil(in / 128)] joins it under the checkpoint's name, so the loader copies
both straight from the checkpoint (a tensor-parallel rank reads its rows or columns and the
scale blocks that cover them). `linear` computes any of the model's Linear products: on CUDA
`mlaserve.kernels.fp8_gemm.block_fp8_linear` (a weight-only w8a16 GEMM at a few tokens, else
the block-FP8 w8a8 GEMM with per-token 1 x 128 activation scales), and on the CPU the weight
dequantized in float32 (weight-only). Where the product is w8a8 the kernel producing a Linear's
input (a norm, SiLU-and-mul) quantizes it as it stores it (`takes_quantized_input`), and the
Linear reads those `QuantizedActivations`.

Which Linears stay high precision: `kv_b_proj`, dequantized to the model dtype at load because
the absorbed MLA products read it per head as W_UK [H, P, L] and W_UV [H, L, V] in the model
dtype (and the expanded prefill up-projects the latents with it), and every tensor that is no
Linear weight (embeddings, norms, router, LM head stay as the checkpoint has them). The routed
experts and the shared experts folded into their stacks stay FP8 too where each expert's I (per
tensor-parallel rank) is a multiple of 128, as the FP8 MoE kernels need
(`MoE.keep_experts_fp8`); otherwise they are dequantized at load.
"""

import re

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.kernels.fp8_blocks import (
    BLOCK_SIZE,
    FP8_DTYPE,
    QuantizedActivations,
    dequantize_block_fp8,
    scale_shape,
)
from mlaserve.kernels.fused import use_fused_kernels

# kv_b_proj; the shared experts go with their MoE's routed experts (MoE.keep_experts_fp8)
_STAYS_DEQUANTIZED = re.compile(r"(^|\.)(kv_b_proj|shared_experts\.\w+)$")
# Whether the kernels that produce a w8a8 product's input quantize it (`takes_quantized_input`);
# False makes every product quantize its own input, the same bits a launch later (tests compare
# the two)
QUANTIZE_IN_PRODUCERS = True


def linear(x: torch.Tensor | QuantizedActivations, weight: torch.Tensor,
           bias: torch.Tensor | None = None,
           weight_scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b for a high-precision or a block-FP8 weight.

    Args:
        x: [..., in] activations in the model dtype; for an FP8 weight also [T, in] quantized
            by their producer (`takes_quantized_input`).
        weight: [out, in], the model dtype; or float8_e4m3fn with weight_scale_inv
            [ceil(out / 128), ceil(in / 128)] float32.
        bias: [out] or None.

    Returns:
        [..., out] in x's dtype. An FP8 weight runs `block_fp8_linear` on CUDA; on the CPU it
        is dequantized (so are quantized activations) and the product computed in float32.
    """
    if weight_scale_inv is None:
        return F.linear(x, weight, bias)
    if x.is_cuda:
        from mlaserve.kernels.fp8_gemm import block_fp8_linear  # imports triton

        y = block_fp8_linear(x, weight, weight_scale_inv)
    else:
        x_float = x.dequantize() if isinstance(x, QuantizedActivations) else x.float()
        y = F.linear(x_float, dequantize_block_fp8(weight, weight_scale_inv)).to(x.dtype)
    return y if bias is None else y + bias


def takes_quantized_input(x: torch.Tensor | QuantizedActivations, weight: torch.Tensor,
                          weight_scale_inv: torch.Tensor | None) -> bool:
    """Whether a Linear with this weight wants its input quantized by the kernel that produces
    it (`fp8_activations`): a block-FP8 weight whose product on x [T, in] (or a tensor of x's
    rows, dtype and device) is a w8a8 one (`fp8_gemm.linear_product_path`), where the fused
    kernels run (`use_fused_kernels`). The producer then stores its output once, in FP8, and
    no quantization launch runs between it and the product."""
    if weight_scale_inv is None or not QUANTIZE_IN_PRODUCERS or not use_fused_kernels(x):
        return False
    from mlaserve.kernels.fp8_gemm import linear_product_path  # imports triton

    return linear_product_path(x, weight) != "weight-only"


def keep_linears_fp8(model: nn.Module, tp_size: int) -> None:
    """Give every Linear of `model` that the checkpoint stores in FP8 (all but kv_b_proj) an
    FP8 `weight` and a float32 `weight_scale_inv` parameter (`keep_linear_fp8`), and let each
    MoE keep its routed and shared experts FP8 where it can (`MoE.keep_experts_fp8`).

    Call on the model as built on the meta device, after its cast to the model dtype (which
    would cast FP8 too).
    """
    for name, module in model.named_modules():
        if hasattr(module, "keep_experts_fp8"):
            module.keep_experts_fp8(name, tp_size)
        elif isinstance(module, nn.Linear) and not _STAYS_DEQUANTIZED.search(name):
            keep_linear_fp8(module, name, tp_size)


def keep_linear_fp8(module: nn.Linear, name: str, tp_size: int) -> None:
    """Make `module` (named `name` in the model) hold an FP8 weight [out, in] and its float32
    weight_scale_inv [ceil(out / 128), ceil(in / 128)], cut like the weight.

    Under tensor parallelism (tp_size > 1) a rank's shard of a split weight must cover whole
    128 x 128 scale blocks: its rows (column-parallel) or columns (row-parallel) a multiple of
    128; otherwise a ValueError names the layer and says to load with --quantization none.
    """
    weight = module.weight  # [out, in], this rank's shard
    shards = getattr(module, "tp_shards", {})
    spec = shards.get("weight")
    if spec is not None and tp_size > 1 and weight.shape[spec.dim] % BLOCK_SIZE[spec.dim]:
        side = ("rows (output features)", "columns (input features)")[spec.dim]
        full = weight.shape[spec.dim] * tp_size
        raise ValueError(
            f"{name}: under tensor_parallel_size {tp_size} each rank holds {full} / "
            f"{tp_size} = {weight.shape[spec.dim]} {side} of the FP8 weight, which does "
            f"not cover whole {BLOCK_SIZE[0]}x{BLOCK_SIZE[1]} scale blocks (it must be a "
            f"multiple of {BLOCK_SIZE[spec.dim]}): use --quantization none to dequantize "
            "the weights at load, or a tensor-parallel size that keeps the shards "
            "block-aligned")
    module.weight = nn.Parameter(torch.empty_like(weight, dtype=FP8_DTYPE),
                                 requires_grad=False)
    module.weight_scale_inv = nn.Parameter(
        torch.empty(scale_shape(weight.shape), dtype=torch.float32, device=weight.device),
        requires_grad=False)
    if spec is not None:
        module.tp_shards = {**shards, "weight_scale_inv": spec}


def product_shapes(model: nn.Module) -> set[tuple[int, int]]:
    """The weight shapes [N, K] of the model's block-FP8 products: its FP8 Linears and the
    stacked ones (`layers.FusedLinear`, plain attributes of the modules that use them); the
    experts' 3-D stacks run the fused MoE instead."""
    shapes = set()
    for module in model.modules():
        for holder in (module, *(v for v in vars(module).values()
                                 if hasattr(v, "weight_scale_inv"))):
            weight = getattr(holder, "weight", None)
            if (getattr(holder, "weight_scale_inv", None) is not None
                    and isinstance(weight, torch.Tensor) and weight.dim() == 2
                    and weight.dtype == FP8_DTYPE):
                shapes.add((weight.shape[0], weight.shape[1]))
    return shapes


# The FP8 Linears whose input no kernel quantizes in the model: o_proj reads attention's output,
# eh_proj (the MTP module's) a concatenation of two norms' outputs
_UNQUANTIZED_INPUT_LINEARS = ("o_proj", "eh_proj")


def unquantized_input_shapes(model: nn.Module) -> set[tuple[int, int]]:
    """The weight shapes [N, K] of the FP8 Linears that get their input in the model dtype (a
    w8a8 product there pays the activation quantization; `fp8_product_choice.measure`)."""
    return {(m.weight.shape[0], m.weight.shape[1]) for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in _UNQUANTIZED_INPUT_LINEARS
            and getattr(m, "weight_scale_inv", None) is not None
            and getattr(m, "weight", None) is not None and m.weight.dtype == FP8_DTYPE}
