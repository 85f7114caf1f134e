"""Triton kernels for the small per-layer ops of MLA: RMSNorm (with the residual add), rotary
embedding, and the latent cache write.

At a few tokens per step a decoder layer's time goes to launching kernels rather than to reading
weights, so each of these ops is one launch:
- `rms_norm`: x [T, N] -> x / rms(x) * weight, one program per row.
- `fused_add_rms_norm`: the decoder's residual stream; residual <- x + residual and
  x <- rms_norm(residual), both in place, one program per row.
- `rotary_embedding`: rope on q_pe [T, H, R] into any [T, H, R] view (the last R columns of the
  absorbed decode query, or q_pe itself), one program per (token, block of heads).
- `write_latent`: kv_a_proj_with_mqa's output [c_kv | k_pe] [T, L + R] -> the cache row
  [rmsnorm(c_kv) | rope(k_pe)] stored at the token's slot of the paged cache, and optionally
  into a [T, L + R] tensor for the prefill path, one program per token.
- `silu_and_mul`: the SwiGLU activation [gate | up] [T, 2I] -> silu(gate) * up [T, I], one
  program per (row, column block).

The norms and `silu_and_mul` feed the model's Linears. Where a Linear runs a w8a8 block-FP8
product, they can quantize their output for it as they store it (`quantize=True`: a
`QuantizedActivations` of FP8 values and 1 x 128 scales, `fp8_activations`) instead of storing
it in x's dtype for a quantization launch to read again; the bits are the same. The norm before
a w8a8 MoE stores both (`keep_rows`): the rows for its router, the quantized rows for its
experts.

Numerics follow the torch code in `mlaserve.model.layers` (HF DeepSeek): the math is float32,
and results are rounded where that code rounds them (stated per function). Rotary angles are the
float32 tables of `RotaryEmbedding.angles` (cos, sin [T, R / 2]; YaRN's cos/sin scale is already
in them). Layouts: DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... or the neox halves
(x_i, x_{i + R/2}); the output keeps the input's layout.

Every launch is fixed by host-side shapes (no host sync, no data-dependent shape), so the kernels
can be captured in CUDA graphs. On CPU tensors they run in Triton's interpreter
(TRITON_INTERPRET=1, for tests).
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.fp8_activations import GROUP, store_quantized_groups
from mlaserve.kernels.fp8_blocks import (
    FP8_MAX,
    QuantizedActivations,
    QuantizedWithRows,
    empty_quantized,
)
from mlaserve.kernels.interpreter import prepare_launch


def _check_rows(name: str, x: torch.Tensor, width: int) -> None:
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(f"{name}: expected [rows, {width}] with unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")


def _check_angles(cos: torch.Tensor, sin: torch.Tensor, num_tokens: int, rope_dim: int) -> None:
    for name, table in (("cos", cos), ("sin", sin)):
        if (table.dtype != torch.float32 or tuple(table.shape) != (num_tokens, rope_dim // 2)
                or table.stride(1) != 1):
            raise ValueError(f"{name}: expected float32 [{num_tokens}, {rope_dim // 2}] with unit "
                             f"column stride, got {table.dtype} {tuple(table.shape)}")
    if cos.stride(0) != sin.stride(0):
        raise ValueError("cos and sin must have the same row stride")


def _norm_warps(block: int) -> int:
    """Warps for one row of `block` elements: about 8 elements per thread, 1 to 16 warps."""
    return max(1, min(16, block // 256))


@triton.jit
def _rms_normalize(x, weight, n_cols, eps, OUT_DTYPE: tl.constexpr):
    """HF DeepSeek's RMSNorm of one row x [BLOCK] (zero past n_cols): float32 statistics,
    x * rsqrt(mean(x^2) + eps) rounded to OUT_DTYPE, times weight, rounded to OUT_DTYPE."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(OUT_DTYPE).to(tl.float32)
    return (normed * weight.to(tl.float32)).to(OUT_DTYPE)


@triton.jit
def _rope_pair_columns(pair, ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Columns of the two halves of rotation pair `pair` in a rope vector of ROPE_DIM."""
    if INTERLEAVED:
        first = 2 * pair
        second = first + 1
    else:
        first = pair
        second = pair + ROPE_DIM // 2
    return first, second


@triton.jit
def _rotate(x1, x2, cos, sin, X_DTYPE: tl.constexpr):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in float32, rounded to X_DTYPE."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return (x1 * cos - x2 * sin).to(X_DTYPE), (x2 * cos + x1 * sin).to(X_DTYPE)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N], read and written when ADD_RESIDUAL
    weight_ptr,  # [N]
    out_ptr,  # [T, N] in x's dtype, unless QUANTIZE
    values_ptr,  # [T, N] FP8 when QUANTIZE
    scales_ptr,  # [T, ceil(N / 128)] float32 when QUANTIZE
    n_cols,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_values,
    stride_scale_row,
    stride_scale_group,
    BLOCK_N: tl.constexpr,  # a power of 2, at least 128 when QUANTIZE
    ADD_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,  # store the rows quantized per 128 columns, not out
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    STORE_ROWS: tl.constexpr = False,  # with QUANTIZE: store out too
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual_row = residual_ptr + row * stride_residual + offs
        residual = tl.load(residual_row, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_row, x, mask=mask)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = _rms_normalize(x, weight, n_cols, eps, x_ptr.dtype.element_ty)  # zero past n_cols
    if QUANTIZE:
        groups = tl.reshape(y.to(tl.float32), (BLOCK_N // GROUP, GROUP))  # [G, 128]
        store_quantized_groups(groups, values_ptr, scales_ptr, row, 0, n_cols, stride_values,
                               stride_scale_row, stride_scale_group, GROUPS=BLOCK_N // GROUP,
                               GROUP=GROUP, FP8_MAX=FP8_MAX)
    if STORE_ROWS or not QUANTIZE:
        tl.store(out_ptr + row * stride_out + offs, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False
             ) -> torch.Tensor | QuantizedActivations:
    """RMSNorm as HF DeepSeek computes it, one launch.

    Args:
        x: [T, N] float32, float16 or bfloat16, unit column stride.
        weight: [N] (normally in x's dtype).
        quantize: return the rows quantized for a w8a8 product instead.

    Returns:
        [T, N] in x's dtype, contiguous: x * rsqrt(mean(x^2) + eps) computed in float32 and
        rounded to x's dtype, then times weight (in float32) and rounded again. With quantize,
        those rows quantized per token and 128 columns (`fp8_activations`).
    """
    num_tokens, n_cols = x.shape
    _check_rows("x", x, n_cols)
    if quantize:
        out = empty_quantized(num_tokens, n_cols, x.dtype, x.device)
    else:
        out = torch.empty(num_tokens, n_cols, dtype=x.dtype, device=x.device)
    if num_tokens:
        _launch_rms_norm(x, x, weight, out, eps, add_residual=False)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, quantize: bool = False, keep_rows: bool = False
                       ) -> tuple[torch.Tensor | QuantizedActivations | QuantizedWithRows,
                                  torch.Tensor]:
    """The decoder's residual stream step, one launch, both tensors updated in place.

    residual <- x + residual: the sum in float32, rounded once to residual's dtype (what torch's
    `x + residual` gives in that dtype). x <- rms_norm(residual) of that rounded residual, with
    `rms_norm`'s rounding.

    Args:
        x: [T, N] (a sublayer's output), float32, float16 or bfloat16.
        residual: [T, N] the residual stream, same dtype as x.
        weight: [N].
        quantize: leave x as it is and return the normalised rows quantized for a w8a8
            product (`rms_norm`).
        keep_rows: with quantize, store the normalised rows in x as well (one launch for a
            consumer that reads both, the MoE's router and its w8a8 experts).

    Returns:
        (x, residual): the same tensors, now holding the normalised rows and the new stream;
        with quantize, (the quantized rows, residual), or with keep_rows too
        (`QuantizedWithRows` of x and the quantized rows, residual).
    """
    num_tokens, n_cols = x.shape
    _check_rows("x", x, n_cols)
    _check_rows("residual", residual, n_cols)
    if residual.shape[0] != num_tokens or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} does not match x "
                         f"{x.dtype} {tuple(x.shape)}")
    out = empty_quantized(num_tokens, n_cols, x.dtype, x.device) if quantize else x
    if num_tokens:
        _launch_rms_norm(x, residual, weight, out, eps, add_residual=True,
                         keep_rows=quantize and keep_rows)
    if quantize and keep_rows:
        return QuantizedWithRows(x, out), residual
    return out, residual


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     out: torch.Tensor | QuantizedActivations, eps: float,
                     add_residual: bool, keep_rows: bool = False) -> None:
    """keep_rows (with quantized out): the rows in x's dtype are stored into x as well."""
    prepare_launch(x)
    num_tokens, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    quantized = isinstance(out, QuantizedActivations)
    if quantized:  # the rows in whole 128-column groups; in x's dtype only with keep_rows
        block = max(block, GROUP)
        out, values, scales = x, out.values, out.scales
    else:
        values, scales = x, x  # unused
    _rms_norm_kernel[(num_tokens,)](
        x, residual, weight, out, values, scales, n_cols, eps, x.stride(0), residual.stride(0),
        out.stride(0), values.stride(0), scales.stride(0), scales.stride(-1), BLOCK_N=block,
        ADD_RESIDUAL=add_residual, QUANTIZE=quantized, FP8_MAX=FP8_MAX, GROUP=GROUP,
        STORE_ROWS=keep_rows, num_warps=_norm_warps(block))


@triton.jit
def _rope_kernel(
    x_ptr,  # [T, H, R]
    cos_ptr,  # [T, R / 2] float32
    sin_ptr,  # [T, R / 2] float32
    out_ptr,  # [T, H, R]
    num_heads,
    stride_x_token,
    stride_x_head,
    stride_out_token,
    stride_out_head,
    stride_angles,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pair = tl.arange(0, BLOCK_PAIRS)
    pair_mask = pair < ROPE_DIM // 2
    mask = (heads < num_heads)[:, None] & pair_mask[None, :]  # [BLOCK_H, BLOCK_PAIRS]
    cos = tl.load(cos_ptr + token * stride_angles + pair, mask=pair_mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_angles + pair, mask=pair_mask, other=0.0)
    first, second = _rope_pair_columns(pair, ROPE_DIM, INTERLEAVED)
    x_row = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head
    x1 = tl.load(x_row + first[None, :], mask=mask, other=0.0)
    x2 = tl.load(x_row + second[None, :], mask=mask, other=0.0)
    y1, y2 = _rotate(x1, x2, cos[None, :], sin[None, :], x_ptr.dtype.element_ty)
    out_row = out_ptr + token * stride_out_token + heads[:, None] * stride_out_head
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_row + first[None, :], y1.to(out_dtype), mask=mask)
    tl.store(out_row + second[None, :], y2.to(out_dtype), mask=mask)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate each head of x by its token's angles, one launch.

    Args:
        x: [T, H, R] or [T, R], float32, float16 or bfloat16; any token and head strides, unit
            column stride (e.g. the q_pe columns of q [T, H, P + R]).
        cos, sin: [T, R / 2] float32 from `RotaryEmbedding.angles`.
        interleaved: pairs (x0, x1), (x2, x3), ... (DeepSeek) or halves (x_i, x_{i + R/2}).
        out: optional destination of x's shape with unit column stride (e.g. the last R
            columns of the absorbed query [T, H, L + R], or x itself).

    Returns:
        out (new in x's dtype when not given): the rotation computed in float32, rounded to x's
        dtype, then stored in out's dtype.
    """
    out = torch.empty_like(x) if out is None else out
    if tuple(out.shape) != tuple(x.shape) or x.dim() not in (2, 3) or x.stride(-1) != 1 or (
            out.stride(-1) != 1):
        raise ValueError(f"x {tuple(x.shape)} and out {tuple(out.shape)} must both be [T, H, R] "
                         "or [T, R] with unit column stride")
    heads_x = x if x.dim() == 3 else x.unsqueeze(1)  # [T, H, R] (H = 1 for [T, R])
    heads_out = out if out.dim() == 3 else out.unsqueeze(1)  # [T, H, R]
    num_tokens, num_heads, rope_dim = heads_x.shape
    _check_angles(cos, sin, num_tokens, rope_dim)
    if num_tokens == 0:
        return out
    prepare_launch(x)
    block_h = min(triton.next_power_of_2(num_heads), 16)
    _rope_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        heads_x, cos, sin, heads_out, num_heads, heads_x.stride(0), heads_x.stride(1),
        heads_out.stride(0), heads_out.stride(1), cos.stride(0), ROPE_DIM=rope_dim,
        BLOCK_H=block_h, BLOCK_PAIRS=triton.next_power_of_2(rope_dim // 2),
        INTERLEAVED=interleaved, num_warps=4)
    return out


@triton.jit
def _write_latent_kernel(
    kv_ptr,  # [T, L + R]: [c_kv | k_pe]
    weight_ptr,  # [L] kv_a_layernorm weight
    cos_ptr,  # [T, R / 2] float32
    sin_ptr,  # [T, R / 2] float32
    slot_ptr,  # [T] int64
    cache_ptr,  # [num_slots, L + R]
    latent_ptr,  # [T, L + R] when STORE_LATENT
    eps,
    stride_kv,
    stride_angles,
    stride_cache,
    stride_latent,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    STORE_LATENT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    kv_dtype = kv_ptr.dtype.element_ty
    cache_dtype = cache_ptr.dtype.element_ty
    kv_row = kv_ptr + token * stride_kv
    cache_row = cache_ptr + tl.load(slot_ptr + token).to(tl.int64) * stride_cache

    cols = tl.arange(0, BLOCK_L)
    col_mask = cols < KV_LORA_RANK
    c_kv = tl.load(kv_row + cols, mask=col_mask, other=0.0)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0)
    c_kv = _rms_normalize(c_kv, weight, KV_LORA_RANK, eps, kv_dtype)

    pair = tl.arange(0, BLOCK_PAIRS)
    pair_mask = pair < ROPE_DIM // 2
    cos = tl.load(cos_ptr + token * stride_angles + pair, mask=pair_mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_angles + pair, mask=pair_mask, other=0.0)
    first, second = _rope_pair_columns(pair, ROPE_DIM, INTERLEAVED)
    first = first + KV_LORA_RANK
    second = second + KV_LORA_RANK
    x1 = tl.load(kv_row + first, mask=pair_mask, other=0.0)
    x2 = tl.load(kv_row + second, mask=pair_mask, other=0.0)
    y1, y2 = _rotate(x1, x2, cos, sin, kv_dtype)

    tl.store(cache_row + cols, c_kv.to(cache_dtype), mask=col_mask)
    tl.store(cache_row + first, y1.to(cache_dtype), mask=pair_mask)
    tl.store(cache_row + second, y2.to(cache_dtype), mask=pair_mask)
    if STORE_LATENT:
        latent_row = latent_ptr + token * stride_latent
        latent_dtype = latent_ptr.dtype.element_ty
        tl.store(latent_row + cols, c_kv.to(latent_dtype), mask=col_mask)
        tl.store(latent_row + first, y1.to(latent_dtype), mask=pair_mask)
        tl.store(latent_row + second, y2.to(latent_dtype), mask=pair_mask)


def write_latent(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, interleaved: bool, kv_cache_flat: torch.Tensor,
                 slot_mapping: torch.Tensor, latent_out: torch.Tensor | None = None) -> None:
    """Normalise c_kv, rotate k_pe and store the latent rows in the paged cache, one launch.

    Row t of the cache at slot_mapping[t] becomes [rmsnorm(c_kv_t) | rope(k_pe_t)]: both parts
    computed in float32 and rounded to kv's dtype as `rms_norm` and `rotary_embedding` round,
    then converted to the cache's dtype. No other cache row is touched.

    Args:
        kv: [T, L + R] kv_a_proj_with_mqa's output [c_kv | k_pe], unit column stride.
        norm_weight: [L] kv_a_layernorm's weight.
        cos, sin: [T, R / 2] float32 from `RotaryEmbedding.angles`.
        interleaved: the rope layout (see `rotary_embedding`).
        kv_cache_flat: [num_slots, L + R] the layer's paged cache viewed as rows.
        slot_mapping: [T] int64 cache row of each token.
        latent_out: optional [T, L + R] (may be kv itself) that also receives the rows, in its
            own dtype (the prefill path reads them).
    """
    num_tokens, width = kv.shape
    kv_lora_rank = norm_weight.shape[0]
    rope_dim = width - kv_lora_rank
    _check_rows("kv", kv, width)
    _check_rows("kv_cache_flat", kv_cache_flat, width)
    if latent_out is not None:
        _check_rows("latent_out", latent_out, width)
    _check_angles(cos, sin, num_tokens, rope_dim)
    if tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping: expected [{num_tokens}], got "
                         f"{tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    prepare_launch(kv)
    latent = kv if latent_out is None else latent_out  # an unused pointer when not stored
    _write_latent_kernel[(num_tokens,)](
        kv, norm_weight, cos, sin, slot_mapping, kv_cache_flat, latent, eps, kv.stride(0),
        cos.stride(0), kv_cache_flat.stride(0), latent.stride(0), KV_LORA_RANK=kv_lora_rank,
        ROPE_DIM=rope_dim, BLOCK_L=triton.next_power_of_2(kv_lora_rank),
        BLOCK_PAIRS=triton.next_power_of_2(rope_dim // 2), INTERLEAVED=interleaved,
        STORE_LATENT=latent_out is not None, num_warps=4)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I] in x's dtype, unless QUANTIZE
    values_ptr,  # [T, I] FP8 when QUANTIZE
    scales_ptr,  # [T, ceil(I / 128)] float32 when QUANTIZE
    inter,
    stride_x,
    stride_out,
    stride_values,
    stride_scale_row,
    stride_scale_group,
    BLOCK: tl.constexpr,  # a power of 2, a multiple of 128 when QUANTIZE
    QUANTIZE: tl.constexpr,  # store the rows quantized per 128 columns, not out
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # rounded as F.silu's output
    y = (silu * up).to(dtype)  # zero past inter
    if QUANTIZE:
        groups = tl.reshape(y.to(tl.float32), (BLOCK // GROUP, GROUP))  # [G, 128]
        store_quantized_groups(groups, values_ptr, scales_ptr, row,
                               tl.program_id(1) * (BLOCK // GROUP), inter, stride_values,
                               stride_scale_row, stride_scale_group, GROUPS=BLOCK // GROUP,
                               GROUP=GROUP, FP8_MAX=FP8_MAX)
    else:
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def silu_and_mul(gate_up: torch.Tensor, quantize: bool = False
                 ) -> torch.Tensor | QuantizedActivations:
    """SwiGLU's activation, one launch.

    Args:
        gate_up: [T, 2I] = [gate | up], float32, float16 or bfloat16, unit column stride.
        quantize: return the rows quantized for a w8a8 product instead.

    Returns:
        [T, I] in gate_up's dtype: silu(gate) computed in float32 and rounded to the dtype, then
        times up in float32 and rounded again (torch's `F.silu(gate) * up`). With quantize,
        those rows quantized per token and 128 columns (`fp8_activations`).
    """
    num_tokens, width = gate_up.shape
    _check_rows("gate_up", gate_up, width)
    inter = width // 2
    if quantize:
        out = empty_quantized(num_tokens, inter, gate_up.dtype, gate_up.device)
        dense, values, scales = gate_up, out.values, out.scales  # dense: unused
    else:
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
        dense, values, scales = out, gate_up, gate_up  # values, scales: unused
    if num_tokens:
        prepare_launch(gate_up)
        block = min(1024, triton.next_power_of_2(inter))
        if quantize:
            block = max(block, GROUP)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate_up, dense, values, scales, inter, gate_up.stride(0), dense.stride(0),
            values.stride(0), scales.stride(0), scales.stride(-1), BLOCK=block,
            QUANTIZE=quantize, FP8_MAX=FP8_MAX, GROUP=GROUP, num_warps=max(1, block // 256))
    return out
