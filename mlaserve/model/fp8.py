"""DeepSeek's block-FP8 checkpoints, as DeepSeek-V3/R1 are published: which tensors are FP8,
and whether the model keeps them so.

A quantized Linear weight `X.weight` [out, in] is stored as torch.float8_e4m3fn next to a float32
`X.weight_scale_inv` [ceil(out / 128), ceil(in / 128)] (the format's math:
`mlaserve.kernels.fp8_blocks`).

Which tensors stay high precision follows the checkpoint; in the published DeepSeek-V2/V3
layout they are the embeddings, the norms, the router (`mlp.gate.weight`), the LM head (and
the multi-token-prediction layer's copies of the embedding and the head, `shared_head.head`) and
`e_score_correction_bias` (`stays_high_precision`); every other Linear weight, experts,
attention projections and the MTP layer's `eh_proj` included, is FP8.

Whether the model keeps those weights FP8 (block-FP8 GEMMs, `mlaserve.model.fp8_linear`) or
dequantizes them at load is decided in one place, `keep_fp8_weights`, from the checkpoint's
`quant_method`, the engine's `quantization` option and the device; `--quantization fp8` also
quantizes a high-precision checkpoint as it loads. Where a weight is dequantized, the loader
does it weight-only, at load, one tensor (or one rank's shard of it) at a time:
`Fp8WeightSlice` indexes like a safetensors slice of the dequantized weight and reads only the
indexed rows / columns of the FP8 tensor and of the scale blocks that cover them.
"""

import re
from typing import Any

import torch

from mlaserve.kernels.fp8_blocks import BLOCK_SIZE, dequantize_block_fp8

SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
_HIGH_PRECISION = re.compile(
    r"(^|\.)(embed_tokens|lm_head|shared_head\.head|mlp\.gate)\.weight$|norm\.weight$"
    r"|e_score_correction_bias$")


FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper, Blackwell


def keep_fp8_weights(quant_method: str | None, quantization: str, device: torch.device
                     ) -> bool:
    """Whether the model's Linear weights are block-FP8 (True) or in the model dtype (False):
    the one place this is decided.

    - `none`: never; every FP8 weight is dequantized at load.
    - `auto`: for an FP8 checkpoint (`quant_method` "fp8") on a CUDA device of compute
      capability >= 8.9, whose tensor cores run the block-FP8 GEMM; on the CPU and older GPUs
      the weights are dequantized at load. A high-precision checkpoint stays as it is.
    - `fp8`: always, on any device. An FP8 checkpoint's weights load as stored; a
      high-precision checkpoint's Linear weights are quantized as they load, into the
      published format (128x128 blocks, `quantize_block_fp8`: what `python -m
      mlaserve.model.fp8_checkpoint quantize` writes); dummy weights are drawn FP8. On the CPU
      each GEMM dequantizes its weight in float32, which keeps FP8's memory, not its speed.

    Args:
        quant_method: the config's `quantization_config.quant_method` (None: not quantized).
        quantization: the engine's option, one of `mlaserve.option_values.QUANTIZATION_MODES`.
        device: where the model runs.
    """
    if quantization == "none" or (quantization == "auto" and quant_method != "fp8"):
        return False
    capable = device.type == "cuda" and (
        torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY)
    if quantization == "auto":
        return capable
    if device.type == "cuda" and not capable:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"--quantization fp8 needs FP8 tensor cores (compute capability >= "
                         f"8.9), this GPU has {major}.{minor}: use --quantization none to "
                         "dequantize the weights at load")
    return True


def stays_high_precision(name: str, tensor: torch.Tensor) -> bool:
    """Whether the published DeepSeek layout keeps checkpoint tensor `name` in bf16/fp32: the
    embeddings, norms, router, LM head, biases and every tensor that is not a 2-D weight."""
    return tensor.dim() != 2 or not name.endswith(".weight") or bool(_HIGH_PRECISION.search(name))


class Fp8WeightSlice:
    """An FP8 weight seen as its dequantized float32 tensor, read lazily: `self[rows, cols]`
    (slices with step 1, as `ShardSpec.take` cuts) reads those rows / columns of the FP8
    tensor and the scale blocks that cover them, and dequantizes only them.

    Args:
        weight: a safetensors slice (or a tensor) of the [out, in] float8_e4m3fn weight.
        scale_inv: a safetensors slice (or a tensor) of its [ceil(out/b0), ceil(in/b1)] scales.
        shape: the weight's (out, in).
        device: where to dequantize (the model's device: the GPU does it faster).
    """

    def __init__(self, weight: Any, scale_inv: Any, shape: tuple[int, int],
                 device: torch.device, block_size: tuple[int, int] = BLOCK_SIZE) -> None:
        self.weight, self.scale_inv, self.shape = weight, scale_inv, tuple(shape)
        self.device, self.block_size = device, block_size

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        """[rows, cols] float32 of the dequantized weight; `index` as for a 2-D tensor."""
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (2 - len(index))
        (r0, r1), (c0, c1) = (_bounds(s, n) for s, n in zip(index, self.shape, strict=True))
        b0, b1 = self.block_size
        weight = self.weight[r0:r1, c0:c1].to(self.device)  # [r1 - r0, c1 - c0] fp8
        scale_inv = self.scale_inv[r0 // b0 : -(-r1 // b0), c0 // b1 : -(-c1 // b1)]
        return dequantize_block_fp8(weight, scale_inv, row_start=r0, col_start=c0,
                                    block_size=self.block_size)

    def full(self) -> torch.Tensor:
        """The whole dequantized weight [out, in] float32."""
        return self[:, :]


def _bounds(index: slice, length: int) -> tuple[int, int]:
    start, stop, step = index.indices(length)
    if step != 1:
        raise ValueError(f"Fp8WeightSlice reads consecutive rows / columns only, not {index}")
    return start, max(start, stop)
