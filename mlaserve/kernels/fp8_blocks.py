"""DeepSeek's block-FP8 format, as DeepSeek-V3/R1 publish their weights: the math only.

A quantized weight [out, in] is torch.float8_e4m3fn next to float32 scales `scale_inv`
[ceil(out / 128), ceil(in / 128)]: element (i, j) is `fp8[i, j] * scale_inv[i // 128, j // 128]`
(the last row / column of blocks may be partial). Quantizing a block: scale = amax(|block|) / 448
(the largest e4m3 value), fp8 = block / scale, and the stored `scale_inv` is that scale (the
name is DeepSeek's: the inverse of the factor that took the weight to FP8). The activations of
the w8a8 GEMMs use the same format with 1 x 128 blocks (`ACTIVATION_BLOCK`), held as
`QuantizedActivations` (the kernels that quantize them: `fp8_activations`).

Which checkpoint tensors are FP8 and what the model does with them is `mlaserve.model.fp8`.
"""

import math
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
BLOCK_SIZE = (128, 128)
ACTIVATION_BLOCK = (1, BLOCK_SIZE[1])  # one scale per token and 128 columns


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x converted to dtype; to float8_e4m3fn it saturates at +-448 (as the GPU's saturating
    conversion does) instead of overflowing to NaN. NaN stays NaN."""
    if dtype == FP8_DTYPE:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def scale_shape(weight_shape: tuple[int, ...],
                block_size: tuple[int, int] = BLOCK_SIZE) -> tuple[int, int]:
    """[out, in] -> the `weight_scale_inv` shape [ceil(out / b0), ceil(in / b1)]."""
    out_features, in_features = weight_shape
    return math.ceil(out_features / block_size[0]), math.ceil(in_features / block_size[1])


def quantize_block_fp8(weight: torch.Tensor, block_size: tuple[int, int] = BLOCK_SIZE
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight per block as DeepSeek's checkpoints are.

    Args:
        weight: [..., out, in], any float dtype; leading dims (a stack of experts) are
            quantized one matrix at a time, each as a checkpoint stores it.

    Returns:
        (fp8 [..., out, in] float8_e4m3fn, scale_inv [..., ceil(out / b0), ceil(in / b1)]
        float32) with scale_inv = amax(|block|) / 448 (1 for an all-zero block) and fp8 =
        weight / scale_inv.
    """
    if weight.dim() > 2:
        fp8 = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        scale_inv = torch.empty(*weight.shape[:-2], *scale_shape(weight.shape[-2:], block_size),
                                device=weight.device)
        for index in range(weight.shape[0]):
            fp8[index], scale_inv[index] = quantize_block_fp8(weight[index], block_size)
        return fp8, scale_inv
    out_features, in_features = weight.shape
    rows, cols = scale_shape(weight.shape, block_size)
    padded = weight.new_zeros(rows * block_size[0], cols * block_size[1], dtype=torch.float32)
    padded[:out_features, :in_features] = weight
    blocks = padded.view(rows, block_size[0], cols, block_size[1])  # [R, b0, C, b1]
    amax = blocks.abs().amax(dim=(1, 3))  # [R, C]
    # A tensor divisor: CUDA torch divides by a Python scalar as a product with its reciprocal,
    # not the correctly rounded quotient the Triton quantization kernels compute.
    scale_inv = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX),
                            torch.ones_like(amax))
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


@dataclass(frozen=True)
class QuantizedActivations:
    """Activations x [M, K] of a w8a8 product, quantized per token and 128 columns.

    values: [M, K] float8_e4m3fn (float32, unrounded, off CUDA: `fp8_activations` says why);
    scales: [M, ceil(K / 128)] float32, M-major on CUDA (`empty_quantized`); x ~= values *
        scales[:, k // 128].
    dtype: the dtype of the activations they stand for (the product's output dtype).
    """

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """[M, K], the activations' shape."""
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def is_cuda(self) -> bool:
        return self.values.is_cuda

    def padded_rows(self, multiple: int) -> "QuantizedActivations":
        """A copy with zero rows (scale 1) up to a multiple of `multiple` rows, M-major scales
        (cuBLASLt's blockwise product wants rows in fours)."""
        rows, num_groups = self.scales.shape
        padded = -(-rows // multiple) * multiple
        values = torch.nn.functional.pad(self.values.view(torch.uint8),
                                         (0, 0, 0, padded - rows))  # zero bytes are +0
        scales = torch.ones(num_groups, padded, dtype=torch.float32,
                            device=self.scales.device).t()  # [padded, G], M-major
        scales[:rows] = self.scales
        return QuantizedActivations(values.view(self.values.dtype), scales, self.dtype)

    def dequantize(self) -> torch.Tensor:
        """x [M, K] float32 as the product reads it: values * their group's scale."""
        return dequantize_block_fp8(self.values, self.scales, block_size=ACTIVATION_BLOCK)


@dataclass(frozen=True)
class QuantizedWithRows:
    """Activations a consumer reads both ways: the rows in their dtype (e.g. the MoE's router)
    and quantized for its w8a8 products (the MoE's experts), written by one producer."""

    rows: torch.Tensor  # [M, K] in the activations' dtype
    quantized: QuantizedActivations  # of the same rows


def scales_column_stride(rows: int) -> int:
    """The column stride of M-major activation scales [rows, G]: rows rounded up to 4 floats
    (16 bytes), what the sm_90 GEMM's TMA copy of a K block's scales needs."""
    return -(-max(rows, 1) // 4) * 4


def empty_quantized(rows: int, cols: int, dtype: torch.dtype, device: torch.device
                    ) -> QuantizedActivations:
    """Uninitialised `QuantizedActivations` of [rows, cols] activations in dtype, for a kernel
    to fill: FP8 values on CUDA (float32 elsewhere) and M-major scales with
    `scales_column_stride` (`fp8_gemm_sm90.tma_ready_scales` takes them as they are)."""
    num_groups = -(-cols // ACTIVATION_BLOCK[1])
    value_dtype = FP8_DTYPE if device.type == "cuda" else torch.float32
    values = torch.empty(rows, cols, dtype=value_dtype, device=device)
    scales = torch.empty_strided((rows, num_groups), (1, scales_column_stride(rows)),
                                 dtype=torch.float32, device=device)
    return QuantizedActivations(values, scales, dtype)
