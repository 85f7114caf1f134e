"""Building blocks: RMSNorm, YaRN rotary embedding, the latent cache write, the SwiGLU MLP
(tensor-parallel: `mlaserve.model.parallel_linear`), and `FusedLinear`, which stacks
projections of one input into one GEMM.

The norms, the rotary embedding, the latent cache write and SiLU-and-multiply have two
implementations: the fused Triton kernels of `mlaserve.kernels.fused_norm_rope` (one launch per
op, CUDA-graph capturable) and the torch code here, which is the CPU path and states the
semantics the kernels follow. Which one runs is decided in one place,
`mlaserve.kernels.fused.use_fused_kernels`: the kernels on CUDA tensors, the torch code on CPU
tensors (tests run the kernels on CPU in Triton's interpreter inside `force_fused_kernels()`).
The norms and SiLU-and-multiply hand a block-FP8 Linear that runs a w8a8 product its input
quantized (`quantize=True`, asked of the Linear: `quantizes_input`).
"""

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config import YarnScaling
from mlaserve.kernels.fp8_blocks import (
    ACTIVATION_BLOCK,
    BLOCK_SIZE,
    QuantizedActivations,
    QuantizedWithRows,
    quantize_block_fp8,
    saturating_cast,
)
from mlaserve.kernels.fused import use_fused_kernels
from mlaserve.model.fp8_linear import linear, takes_quantized_input
from mlaserve.model.parallel_linear import ColumnParallelLinear, RowParallelLinear


def _kernels() -> ModuleType:
    from mlaserve.kernels import fused_norm_rope  # imports triton, needed on this path only

    return fused_norm_rope


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as HF DeepSeek does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, quantize: bool = False
                ) -> torch.Tensor | QuantizedActivations:
        """x [T, N] -> [T, N] in x's dtype (a new tensor); with quantize, quantized for a w8a8
        product."""
        if use_fused_kernels(x):
            return _kernels().rms_norm(x, self.weight, self.eps, quantize=quantize)
        return _quantized(self._normalize(x)) if quantize else self._normalize(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, quantize: bool = False,
                     keep_rows: bool = False
                     ) -> tuple[torch.Tensor | QuantizedActivations | QuantizedWithRows,
                                torch.Tensor]:
        """One step of the residual stream: (norm(x + residual), x + residual).

        Args:
            x: [T, N] a sublayer's output.
            residual: [T, N] the stream before that sublayer, in x's dtype.
            quantize: return norm(x + residual) quantized for a w8a8 product.
            keep_rows: with quantize, return the rows in x's dtype too (`QuantizedWithRows`,
                for the MoE: its router reads the rows, its experts the quantized ones).

        Returns:
            (normed, residual) [T, N] in x's dtype. The sum is rounded to x's dtype once and
            normalised as rounded. The fused kernel writes them into x and residual in place
            (one launch; with quantize, the normed rows into new `QuantizedActivations`); the
            torch code returns new tensors.
        """
        if use_fused_kernels(x):
            return _kernels().fused_add_rms_norm(x, residual, self.weight, self.eps,
                                                 quantize=quantize, keep_rows=keep_rows)
        residual = x + residual
        normed = self._normalize(residual)
        if not quantize:
            return normed, residual
        quantized = _quantized(normed)
        return QuantizedWithRows(normed, quantized) if keep_rows else quantized, residual

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """Inverse frequencies [dim // 2] float32, with DeepSeek's YaRN blend when `yarn` is set."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = theta ** exponents
    extrapolation = 1.0 / pos_freqs
    if yarn is None:
        return extrapolation
    interpolation = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings
                               / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


class RotaryEmbedding(nn.Module):
    """Rotary embedding over the qk_rope_head_dim slice, with a precomputed cos/sin table.

    DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`, the default);
    otherwise the two halves of the vector (neox layout). Math in float32.
    """

    def __init__(self, dim: int, max_positions: int, theta: float,
                 yarn: YarnScaling | None, interleaved: bool) -> None:
        super().__init__()
        self.dim = dim
        self.max_positions = max_positions
        self.theta = theta
        self.yarn = yarn
        self.interleaved = interleaved
        with torch.device("cpu"):  # real tables even when the model is built on meta
            self.build(torch.device("cpu"))

    def build(self, device: torch.device) -> None:
        """(Re)compute the float32 cos/sin tables [max_positions, dim / 2] on `device`."""
        inv_freq = rope_inv_freq(self.dim, self.theta, self.yarn)
        scale = self.yarn.cos_sin_scale if self.yarn is not None else 1.0
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        self.cos = (freqs.cos() * scale).to(device)  # plain attributes: never cast by .to(dtype)
        self.sin = (freqs.sin() * scale).to(device)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim / 2] float32 at positions [T]; gathered once per step for all layers."""
        return self.cos[positions], self.sin[positions]

    def forward(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor],
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate x [T, H, dim] or [T, dim] by `angles(positions)`.

        Args:
            out: optional destination of x's shape (a view into a larger tensor, or x itself).

        Returns:
            out, or a new tensor in x's dtype: the rotation computed in float32 and rounded to
            x's dtype.
        """
        if use_fused_kernels(x):
            return _kernels().rotary_embedding(x, *angles, self.interleaved, out=out)
        rotated = self._rotate(x, angles)
        return rotated if out is None else out.copy_(rotated)

    def _rotate(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = angles
        cos = cos.view(cos.shape[0], *([1] * (x.dim() - 2)), -1)  # [T, 1.., dim/2]
        sin = sin.view(sin.shape[0], *([1] * (x.dim() - 2)), -1)
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            return out.flatten(-2).to(x.dtype)  # [..., dim/2, 2] -> [..., dim]
        half = self.dim // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def write_latent_cache(kv: torch.Tensor, norm: RMSNorm, rotary: RotaryEmbedding,
                       angles: tuple[torch.Tensor, torch.Tensor], kv_cache_flat: torch.Tensor,
                       slot_mapping: torch.Tensor, keep_rows: bool) -> torch.Tensor | None:
    """Store a step's latent rows [norm(c_kv) | rope(k_pe)] in the paged cache.

    Args:
        kv: [T, L + R] kv_a_proj_with_mqa's output [c_kv | k_pe].
        norm: kv_a_layernorm (its weight is [L]).
        angles: (cos, sin) [T, R / 2] float32 from `RotaryEmbedding.angles`.
        kv_cache_flat: [num_slots, L + R] the layer's cache viewed as rows.
        slot_mapping: [T] int64, the cache row of each token.
        keep_rows: whether the caller needs the rows back (the prefill path does).

    Returns:
        The rows [T, L + R] in kv's dtype when keep_rows (the fused kernel writes them over kv),
        else None. Row t is stored, converted to the cache's dtype, at slot_mapping[t].
    """
    if use_fused_kernels(kv):
        _kernels().write_latent(kv, norm.weight, norm.eps, *angles, rotary.interleaved,
                                kv_cache_flat, slot_mapping, latent_out=kv if keep_rows else None)
        return kv if keep_rows else None
    c_kv, k_pe = kv.split([norm.weight.shape[0], rotary.dim], dim=-1)
    latent = torch.cat((norm(c_kv), rotary(k_pe, angles)), dim=-1)
    rows = saturating_cast(latent, kv_cache_flat.dtype)
    if rows.element_size() == 1:  # FP8: index_copy_ has no float8 kernels; copy the bytes
        kv_cache_flat, rows = kv_cache_flat.view(torch.uint8), rows.view(torch.uint8)
    kv_cache_flat.index_copy_(0, slot_mapping, rows)
    return latent if keep_rows else None


class FusedLinear:
    """Linears that read the same input, stacked into one weight so one GEMM computes them all.

    weight [sum N_i, K] (and bias [sum N_i] when any linear has one) over linears with weights
    [N_i, K]. Block-FP8 linears (`mlaserve.model.fp8_linear`) stack their float8_e4m3fn
    weights and their `weight_scale_inv` blocks; a linear whose N_i is not a multiple of 128
    (but the last) is padded with zero rows to whole scale blocks, and the GEMM's padding
    columns are dropped from the output. Each linear's weight, bias and scales become views
    into the stacks (no second copy), so parameter names and `state_dict` stay those of the
    checkpoint.
    """

    def __init__(self, *linears: nn.Linear) -> None:
        scales = [getattr(layer, "weight_scale_inv", None) for layer in linears]
        if len({scale is None for scale in scales}) > 1:
            raise ValueError("fused linears are all block-FP8 or all high precision")
        fp8 = scales[0] is not None
        rows = [layer.out_features for layer in linears]
        block = BLOCK_SIZE[0] if fp8 else 1
        padded = [-(-n // block) * block for n in rows[:-1]] + rows[-1:]
        self.weight = torch.cat([_pad_rows(layer.weight.detach(), n) for layer, n in zip(
            linears, padded, strict=True)])  # [sum padded N_i, K]
        self.bias = None
        given = [layer.bias.detach() for layer in linears if layer.bias is not None]
        if given:  # zeros for the linears without one
            self.bias = torch.cat([_pad_rows(
                layer.bias.detach() if layer.bias is not None else given[0].new_zeros(0), n)
                for layer, n in zip(linears, padded, strict=True)])  # [sum padded N_i]
        self.weight_scale_inv = torch.cat([s.detach() for s in scales]) if fp8 else None
        starts = [sum(padded[:i]) for i in range(len(linears))]
        # the output columns to keep, None when nothing is padded
        self.columns = None if padded == rows else torch.cat(
            [torch.arange(a, a + n) for a, n in zip(starts, rows, strict=True)]).to(
            self.weight.device)  # [sum N_i]
        for layer, start, n in zip(linears, starts, rows, strict=True):
            layer.weight = nn.Parameter(self.weight[start : start + n], requires_grad=False)
            if layer.bias is not None:
                layer.bias = nn.Parameter(self.bias[start : start + n], requires_grad=False)
            if fp8:
                first = start // block
                layer.weight_scale_inv = nn.Parameter(
                    self.weight_scale_inv[first : first + -(-n // block)], requires_grad=False)

    def quantizes_input(self, x: torch.Tensor) -> bool:
        """Whether x's producer should quantize it for this GEMM (`takes_quantized_input`)."""
        return takes_quantized_input(x, self.weight, self.weight_scale_inv)

    def __call__(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        """x [T, K] -> [T, sum N_i] in x's dtype: the linears' outputs side by side, in order."""
        y = linear(x, self.weight, self.bias, self.weight_scale_inv)  # [T, sum padded N_i]
        return y if self.columns is None else y.index_select(-1, self.columns)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """tensor [N, ...] followed by zero rows up to [rows, ...]."""
    return torch.cat((tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])))


def silu_and_mul(gate_up: torch.Tensor, quantize: bool = False
                 ) -> torch.Tensor | QuantizedActivations:
    """[T, 2I] = [gate | up] -> silu(gate) * up [T, I] in gate_up's dtype (silu rounded to that
    dtype before the product, as torch computes `F.silu(gate) * up`); with quantize, quantized
    for a w8a8 product."""
    if use_fused_kernels(gate_up):
        return _kernels().silu_and_mul(gate_up, quantize=quantize)
    gate, up = gate_up.chunk(2, dim=-1)
    return _quantized(F.silu(gate) * up) if quantize else F.silu(gate) * up


def _quantized(x: torch.Tensor) -> QuantizedActivations:
    """The torch code's quantization of x [T, N] per token and 128 columns, as the fused
    kernels quantize their output."""
    return QuantizedActivations(*quantize_block_fp8(x, ACTIVATION_BLOCK), x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense FFN and the shared experts.

    Under tensor parallelism each rank holds I / size of the intermediate columns (gate and up
    column-parallel, down row-parallel): the SwiGLU is per column, so a rank's down projection
    is a partial sum of the output, all-reduced by down_proj (or by the caller when
    reduce_results is False). After loading, gate and up run as one GEMM over their stacked
    local weights (`FusedLinear`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size,
                                           reduce_results=reduce_results)

    def process_weights_after_loading(self) -> None:
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)  # [2I / size, D]

    def quantizes_input(self, x: torch.Tensor) -> bool:
        """Whether x's producer should quantize it for gate_up (`takes_quantized_input`)."""
        return self.gate_up.quantizes_input(x)

    def forward(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        gate_up = self.gate_up(x)  # [T, 2I / size]
        return self.down_proj(silu_and_mul(gate_up, self.down_proj.quantizes_input(gate_up)))
