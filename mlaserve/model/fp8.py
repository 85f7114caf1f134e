"""DeepSeek's block-FP8 weight format, as DeepSeek-V3/R1 are published.

A quantized Linear weight `X.weight` [out, in] is stored as torch.float8_e4m3fn next to a float32
`X.weight_scale_inv` [ceil(out / 128), ceil(in / 128)]: element (i, j) of the weight is
`fp8[i, j] * scale_inv[i // 128, j // 128]` (the last row / column of blocks may be partial).
Quantizing a block: scale = amax(|block|) / 448 (the largest e4m3 value), fp8 = block / scale,
and the stored `scale_inv` is that scale (the name is DeepSeek's: it is the inverse of the
factor that took the weight to FP8).

Which tensors stay high precision follows the checkpoint; in the published DeepSeek-V2/V3
layout they are the embeddings, the norms, the router (`mlp.gate.weight`), the LM head and
`e_score_correction_bias` (`stays_high_precision`); every other Linear weight, experts and
attention projections included, is FP8.

Whether the model keeps those weights FP8 (block-FP8 GEMMs, `mlaserve.model.fp8_linear`) or
dequantizes them at load is decided in one place, `keep_fp8_weights`, from the checkpoint's
`quant_method`, the engine's `quantization` option and the device. Where a weight is
dequantized, the loader does it weight-only, at load, one tensor (or one rank's shard of it) at
a time: `Fp8WeightSlice` indexes like a safetensors slice of the dequantized weight and reads
only the indexed rows / columns of the FP8 tensor and of the scale blocks that cover them.
"""

import math
import re
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
BLOCK_SIZE = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
_HIGH_PRECISION = re.compile(
    r"(^|\.)(embed_tokens|lm_head|mlp\.gate)\.weight$|norm\.weight$|e_score_correction_bias$")


FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper, Blackwell


def keep_fp8_weights(quant_method: str | None, quantization: str, device: torch.device,
                     dummy: bool) -> bool:
    """Whether the model's Linear weights stay block-FP8 (True) or are dequantized to the model
    dtype at load (False): the one place this is decided.

    - `none`: never; every FP8 weight is dequantized at load.
    - `auto`: for an FP8 checkpoint (`quant_method` "fp8") on a CUDA device of compute
      capability >= 8.9, whose tensor cores run the block-FP8 GEMM; on the CPU and older GPUs
      the weights are dequantized at load.
    - `fp8`: always, on any device. The checkpoint must be FP8 (dummy weights are drawn FP8
      whatever the config says); on the CPU each GEMM dequantizes its weight in float32, which
      keeps FP8's memory, not its speed.

    Args:
        quant_method: the config's `quantization_config.quant_method` (None: not quantized).
        quantization: the engine's option, one of `mlaserve.option_values.QUANTIZATION_MODES`.
        device: where the model runs.
        dummy: whether the weights are drawn at random instead of read (`--load-format dummy`).
    """
    if quantization == "none" or (quantization == "auto" and quant_method != "fp8"):
        return False
    capable = device.type == "cuda" and (
        torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY)
    if quantization == "auto":
        return capable
    if quant_method != "fp8" and not dummy:
        raise ValueError("--quantization fp8 keeps a block-FP8 checkpoint's weights FP8, but "
                         "this checkpoint is not FP8 (its config.json has no "
                         "quantization_config): write an FP8 copy with `python -m "
                         "mlaserve.model.fp8_checkpoint quantize SRC DST`, or use "
                         "--quantization auto")
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


def scale_shape(weight_shape: tuple[int, ...],
                block_size: tuple[int, int] = BLOCK_SIZE) -> tuple[int, int]:
    """[out, in] -> the `weight_scale_inv` shape [ceil(out / b0), ceil(in / b1)]."""
    out_features, in_features = weight_shape
    return math.ceil(out_features / block_size[0]), math.ceil(in_features / block_size[1])


def quantize_block_fp8(weight: torch.Tensor, block_size: tuple[int, int] = BLOCK_SIZE
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight per block as DeepSeek's checkpoints are.

    Args:
        weight: [out, in], any float dtype.

    Returns:
        (fp8 [out, in] float8_e4m3fn, scale_inv [ceil(out / b0), ceil(in / b1)] float32) with
        scale_inv = amax(|block|) / 448 (1 for an all-zero block) and fp8 = weight / scale_inv.
    """
    out_features, in_features = weight.shape
    rows, cols = scale_shape(weight.shape, block_size)
    padded = weight.new_zeros(rows * block_size[0], cols * block_size[1], dtype=torch.float32)
    padded[:out_features, :in_features] = weight
    blocks = padded.view(rows, block_size[0], cols, block_size[1])  # [R, b0, C, b1]
    amax = blocks.abs().amax(dim=(1, 3))  # [R, C]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    fp8 = scaled.view_as(padded)[:out_features, :in_features].to(FP8_DTYPE)
    return fp8.contiguous(), scale_inv


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, *, row_start: int = 0,
                         col_start: int = 0, block_size: tuple[int, int] = BLOCK_SIZE
                         ) -> torch.Tensor:
    """fp8 * scale_inv of each element's block, in float32.

    Args:
        weight: [..., r, c] float8_e4m3fn, rows row_start .. row_start + r and columns
            col_start .. col_start + c of the full weight (the whole weight with the default
            starts); leading dims (a stack of experts) are dequantized alike.
        scale_inv: [..., blocks, blocks] float32 scale blocks from block row row_start // b0
            and block column col_start // b1 on, covering at least `weight`.

    Returns:
        [..., r, c] float32, the dequantized rows and columns.
    """
    rows = (torch.arange(row_start, row_start + weight.shape[-2]) // block_size[0]
            - row_start // block_size[0])  # [r]: each row's block row in scale_inv
    cols = (torch.arange(col_start, col_start + weight.shape[-1]) // block_size[1]
            - col_start // block_size[1])  # [c]
    scale = scale_inv.to(device=weight.device, dtype=torch.float32)
    scale = scale.index_select(-2, rows.to(scale.device)).index_select(
        -1, cols.to(scale.device))  # [..., r, c]
    return weight.to(torch.float32) * scale


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
