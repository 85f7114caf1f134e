"""Triton kernels for the routed experts: sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)).

The T * K (token, slot) pairs are grouped by expert on the device (`moe_align.align_by_expert`):
each expert's pairs fill a run of rows padded to a multiple of BLOCK_M, so every M-block of rows
belongs to one expert and reads that expert's weights once per N-block. Every launch is fixed by
host-side shapes, so the whole computation can be captured in a CUDA graph; programs past the
valid rows exit at once.

Then two GEMM kernels:
- `_gate_up_silu_kernel`: an M-block of one expert against the gate rows and the up rows of the
  same BLOCK_N columns (two float32 accumulators), silu(gate) * up in the epilogue, stored in
  x's dtype as the activation [max_padded, I] in the padded row order.
- `_down_kernel`: the activation's rows against the expert's down projection; the epilogue
  scales each row by its routing weight and stores it as row (token, slot) of [T, K, D], which
  one `.sum(dim=1)` reduces (deterministic, no atomics).

Weights are read K-major as stored ([E, 2I, D] and [E, D, I]). Tile sizes come from
`fused_moe_config.moe_config` (one place): 16-row M-blocks with wide K tiles while experts get a few
rows each (decode, weight streaming), 64-128-row blocks as the rows per expert grow (prefill).
Either kernel can compute its tiles transposed, [BLOCK_N, BLOCK_M] (`GemmTiles.swap_ab`), which
gives small M-blocks Hopper's wgmma (the weight's columns as its 64 rows).

Block-FP8 experts (w8a8, DeepSeek's format: float8_e4m3fn weights with a float32 scale per
128x128 block, `fp8_blocks.py`) run through the same kernels: x and the activation are quantized
per token and 128-column group (`fp8_activations.quantize_activations`), every BLOCK_K step (BLOCK_K
divides 128, so it lies in one scale block) is one FP8 `tl.dot` scaled by the rows' activation
scales times the columns' weight scales (looked up per column, so any BLOCK_N works) and added to
the float32 accumulator. The activation is rounded to x's dtype before it is quantized, as in the
16-bit path. Where the gate kernel's tiles are one scale group wide (block_n = 128), its epilogue
quantizes the activation it computes (each row's amax over the tile's 128 columns) and stores FP8
values and scales, so no launch of its own quantizes it; with other tiles `quantize_activations`
does, between the two kernels. Both give the same bits.

On CPU tensors the kernels run in Triton's interpreter (TRITON_INTERPRET=1, for tests), where
`tl.dot` needs M, N, K >= 16 and is faithful in float32 and float16 only.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.fp8_activations import GROUP, quantize_activations
from mlaserve.kernels.fp8_blocks import (
    BLOCK_SIZE,
    FP8_DTYPE,
    FP8_MAX,
    QuantizedActivations,
    empty_quantized,
)
from mlaserve.kernels.fused_moe_config import FusedMoEConfig, GemmTiles, moe_config
from mlaserve.kernels.moe_align import ExpertAlignment, align_by_expert
from mlaserve.kernels.moe_common import check_fp8_experts

_FP8_MAX = tl.constexpr(FP8_MAX)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _product(a, w, acc, DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] @ w [BLOCK_K, BLOCK_N]: acc [BLOCK_M, BLOCK_N], or with
    SWAP_AB its transpose [BLOCK_N, BLOCK_M] (w^T a^T)."""
    if SWAP_AB:
        return tl.dot(tl.trans(w), tl.trans(a), acc, input_precision=DOT_PRECISION)
    else:
        return tl.dot(a, w, acc, input_precision=DOT_PRECISION)


@triton.jit
def _scaled_product(a, w, a_scale, w_scale, SWAP_AB: tl.constexpr):
    """One FP8 K step: a @ w (as `_product` lays it out) times the rows' activation scales
    a_scale [BLOCK_M] and the columns' weight scales w_scale [BLOCK_N]."""
    if SWAP_AB:
        return tl.dot(tl.trans(w), tl.trans(a)) * (w_scale[:, None] * a_scale[None, :])
    else:
        return tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])


@triton.jit
def _tile_offsets(row_offs, row_mask, col_offs, col_mask, SWAP_AB: tl.constexpr):
    """Offsets and mask of an output tile from per-row [BLOCK_M] and per-column [BLOCK_N]
    ones, laid out as `_product` lays out its tile."""
    if SWAP_AB:
        return row_offs[None, :] + col_offs[:, None], row_mask[None, :] & col_mask[:, None]
    else:
        return row_offs[:, None] + col_offs[None, :], row_mask[:, None] & col_mask[None, :]


@triton.jit
def _quantize_rows(y, SWAP_AB: tl.constexpr):
    """One scale group per row of a tile laid out as `_product` lays it out (y: the rows'
    values over one group's 128 columns, float32): (y / scale clamped to +-FP8_MAX, scale
    [BLOCK_M]) with scale = amax |y| / FP8_MAX (1 for an all-zero row), both divisions
    correctly rounded: `fp8_activations.quantize_activations`' arithmetic."""
    if SWAP_AB:
        amax = tl.max(tl.abs(y), axis=0)
    else:
        amax = tl.max(tl.abs(y), axis=1)
    scale = tl.where(amax > 0.0, tl.div_rn(amax, _FP8_MAX), 1.0)
    if SWAP_AB:
        y = tl.div_rn(y, scale[None, :])
    else:
        y = tl.div_rn(y, scale[:, None])
    return tl.clamp(y, -_FP8_MAX, _FP8_MAX), scale


@triton.jit
def _tile_of_program(pid, num_m_blocks, num_n_blocks, GROUP_SIZE_M: tl.constexpr):
    """Program id -> (M-block, N-block): GROUP_SIZE_M M-blocks in a row share each N-block."""
    group_width = GROUP_SIZE_M * num_n_blocks
    first_m = pid // group_width * GROUP_SIZE_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_SIZE_M)
    return first_m + pid % group_width % group_rows, pid % group_width // group_rows


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _gate_up_silu_kernel(
    x_ptr,  # [T, D]
    w_ptr,  # [E, 2I, D]: gate rows then up rows
    act_ptr,  # [max_padded, I], out, unit column stride (QUANTIZE_ACT: the FP8 values)
    act_scale_ptr,  # QUANTIZE_ACT: [max_padded, I / 128] float32, out, any strides
    x_scale_ptr,  # FP8: [T, ceil(D / 128)] float32, any strides
    w_scale_ptr,  # FP8: [E, 2I / 128, ceil(D / 128)] float32, unit column stride
    sorted_ids_ptr,  # [max_padded] int32
    expert_ids_ptr,  # [num_m_blocks] int32
    num_padded_ptr,  # [1] int32
    num_pairs,
    top_k,
    hidden,
    inter,
    num_m_blocks,
    stride_xt,
    stride_xd,
    stride_we,
    stride_wn,
    stride_wd,
    stride_am,
    stride_asm,
    stride_asg,
    stride_xst,
    stride_xsg,
    stride_wse,
    stride_wsn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    SWAP_AB: tl.constexpr,
    QUANTIZE_ACT: tl.constexpr,  # BLOCK_N == 128: store the activation quantized
    ACT_DTYPE: tl.constexpr,  # the activation's dtype (rounded to it before quantizing)
):
    pid_m, pid_n = _tile_of_program(tl.program_id(0), num_m_blocks, tl.cdiv(inter, BLOCK_N),
                                    GROUP_SIZE_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows)
    valid = pairs < num_pairs
    tokens = pairs // top_k
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past `inter` wrap: their loads stay in bounds and their results are not stored.
    w_cols = cols % inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xd  # [BLOCK_M, BLOCK_K]
    gate_ptrs = w_ptr + expert * stride_we + w_cols[None, :] * stride_wn + ks[:, None] * stride_wd
    up_ptrs = gate_ptrs + inter * stride_wn  # [BLOCK_K, BLOCK_N] like gate_ptrs
    x_scale_ptrs = x_scale_ptr + tokens * stride_xst  # [BLOCK_M]
    gate_scale_ptrs = w_scale_ptr + expert * stride_wse + w_cols // 128 * stride_wsn  # [BLOCK_N]
    up_scale_ptrs = gate_scale_ptrs + inter // 128 * stride_wsn  # gate and up: I % 128 == 0
    if SWAP_AB:
        gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros_like(gate)
    for k in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
            w_gate = tl.load(gate_ptrs)
            w_up = tl.load(up_ptrs)
        else:
            in_k = ks < hidden - k
            a = tl.load(x_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
            w_gate = tl.load(gate_ptrs, mask=in_k[:, None], other=0.0)
            w_up = tl.load(up_ptrs, mask=in_k[:, None], other=0.0)
        if FP8:  # the step lies in scale block k // 128 (BLOCK_K divides 128)
            a_scale = tl.load(x_scale_ptrs + k // 128 * stride_xsg, mask=valid, other=0.0)
            gate += _scaled_product(a, w_gate, a_scale, tl.load(gate_scale_ptrs + k // 128),
                                    SWAP_AB)
            up += _scaled_product(a, w_up, a_scale, tl.load(up_scale_ptrs + k // 128), SWAP_AB)
        else:
            gate = _product(a, w_gate, gate, DOT_PRECISION, SWAP_AB)
            up = _product(a, w_up, up, DOT_PRECISION, SWAP_AB)
        x_ptrs += BLOCK_K * stride_xd
        gate_ptrs += BLOCK_K * stride_wd
        up_ptrs += BLOCK_K * stride_wd
    act = gate * tl.sigmoid(gate) * up
    offs, mask = _tile_offsets(rows * stride_am, valid, cols, cols < inter, SWAP_AB)
    if QUANTIZE_ACT:
        act, scale = _quantize_rows(act.to(ACT_DTYPE).to(tl.float32), SWAP_AB)
        tl.store(act_scale_ptr + rows * stride_asm + pid_n * stride_asg, scale, mask=valid)
    tl.store(act_ptr + offs, act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _down_kernel(
    act_ptr,  # [max_padded, I], unit column stride
    w_ptr,  # [E, D, I]
    out_ptr,  # [T * K, D], out, unit column stride
    act_scale_ptr,  # FP8: [max_padded, I / 128] float32, any strides
    w_scale_ptr,  # FP8: [E, ceil(D / 128), I / 128] float32, unit column stride
    topk_weights_ptr,  # [T * K] float32
    sorted_ids_ptr,  # [max_padded] int32
    expert_ids_ptr,  # [num_m_blocks] int32
    num_padded_ptr,  # [1] int32
    num_pairs,
    hidden,
    inter,
    num_m_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_asm,
    stride_asg,
    stride_wse,
    stride_wsn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    pid_m, pid_n = _tile_of_program(tl.program_id(0), num_m_blocks, tl.cdiv(hidden, BLOCK_N),
                                    GROUP_SIZE_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows)
    valid = pairs < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = cols % hidden  # wrapped like the gate kernel's columns
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_am + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + w_cols[None, :] * stride_wn + ks[:, None] * stride_wk
    a_scale_ptrs = act_scale_ptr + rows * stride_asm  # [BLOCK_M]
    w_scale_ptrs = w_scale_ptr + expert * stride_wse + w_cols // 128 * stride_wsn  # [BLOCK_N]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            in_k = ks < inter - k
            a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
        if FP8:  # as in the gate kernel
            a_scale = tl.load(a_scale_ptrs + k // 128 * stride_asg, mask=valid, other=0.0)
            acc += _scaled_product(a, w, a_scale, tl.load(w_scale_ptrs + k // 128), SWAP_AB)
        else:
            acc = _product(a, w, acc, DOT_PRECISION, SWAP_AB)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    routing = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)
    if SWAP_AB:
        out = acc * routing[None, :]
    else:
        out = acc * routing[:, None]
    offs, mask = _tile_offsets(pairs.to(tl.int64) * stride_om, valid, cols, cols < hidden,
                               SWAP_AB)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str | None:
    """float32 inputs multiply in full precision (torch's default), not TF32."""
    return "ieee" if dtype == torch.float32 else None


def _scale_args(scales: tuple[torch.Tensor, torch.Tensor] | None, dummy: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    """The kernels' scale operands: (activation scales, weight scales, the activation scales'
    row and group strides, the weight scales' expert and row strides); `dummy` and zero
    strides without FP8. The activation scales are read as they are (CUDA's
    `quantize_activations` writes them M-major), the weight scales with unit column stride."""
    if scales is None:
        return dummy, dummy, 0, 0, 0, 0
    act_scales, weight_scales = scales[0], scales[1].contiguous()
    return act_scales, weight_scales, *act_scales.stride(), *weight_scales.stride()[:2]


def gate_up_silu(x: torch.Tensor, gate_up_proj: torch.Tensor, alignment: ExpertAlignment,
                 top_k: int, tiles: GemmTiles,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 act_dtype: torch.dtype | None = None, quantize_act: bool = False
                 ) -> torch.Tensor | QuantizedActivations:
    """silu(x gate_e^T) * (x up_e^T) for every aligned row.

    Args:
        x: [T, D]; gate_up_proj: [E, 2I, D] (gate rows then up rows), x's dtype.
        scales: FP8 only (x and gate_up_proj float8_e4m3fn): x's per-token-group scales
            [T, ceil(D / 128)] and the weight's scales [E, 2I / 128, ceil(D / 128)], float32.
        act_dtype: the activation's dtype (default x's).
        quantize_act: FP8 with tiles one scale group wide (block_n = 128) only: quantize the
            activation in the kernel's epilogue, as `quantize_activations` would.

    Returns:
        [max_padded, I] in act_dtype; row r is pair sorted_ids[r]'s activation (rows of
        padding are not written). With quantize_act, `QuantizedActivations` of it instead
        (values [max_padded, I], scales [max_padded, I / 128]).
    """
    num_tokens, hidden = x.shape
    inter = gate_up_proj.shape[1] // 2
    max_padded = alignment.sorted_ids.shape[0]
    num_m_blocks = alignment.expert_ids.shape[0]
    act_dtype = act_dtype or x.dtype
    if quantize_act and (scales is None or tiles.block_n != GROUP):
        raise ValueError(f"the gate kernel quantizes its activation with FP8 operands and "
                         f"block_n {GROUP} only, not block_n {tiles.block_n}")
    if quantize_act:
        # float32 values off CUDA, rounded to FP8 by torch below (the interpreter's float8
        # conversion is wrong: `fp8_activations`)
        act = empty_quantized(max_padded, inter, act_dtype, x.device)
        act_values, act_scales = act.values, act.scales
    else:
        act = act_values = torch.empty(max_padded, inter, dtype=act_dtype, device=x.device)
        act_scales = x  # unused
    grid = (num_m_blocks * triton.cdiv(inter, tiles.block_n),)
    x_scales, w_scales, *scale_strides = _scale_args(scales, x)
    _gate_up_silu_kernel[grid](
        x, gate_up_proj, act_values, act_scales, x_scales, w_scales, alignment.sorted_ids,
        alignment.expert_ids, alignment.num_padded, num_tokens * top_k, top_k, hidden, inter,
        num_m_blocks, x.stride(0), x.stride(1), *gate_up_proj.stride(), act_values.stride(0),
        *(act_scales.stride() if quantize_act else (0, 0)), *scale_strides,
        BLOCK_M=alignment.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_SIZE_M=tiles.group_size_m, EVEN_K=hidden % tiles.block_k == 0,
        DOT_PRECISION=_dot_precision(x.dtype), FP8=scales is not None, SWAP_AB=tiles.swap_ab,
        QUANTIZE_ACT=quantize_act, ACT_DTYPE=_TL_DTYPES[act_dtype],
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if quantize_act and act_values.dtype != FP8_DTYPE:
        return QuantizedActivations(act_values.to(FP8_DTYPE), act_scales, act_dtype)
    return act


def down_weighted(act: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
                  alignment: ExpertAlignment, tiles: GemmTiles,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  out_dtype: torch.dtype | None = None, has_unrouted: bool = False
                  ) -> torch.Tensor:
    """w_k * act down_e^T per pair, in the pairs' original order.

    Args:
        act: [max_padded, I] from `gate_up_silu`; down_proj: [E, D, I], act's dtype.
        topk_weights: [T, K] float32.
        scales: FP8 only (act and down_proj float8_e4m3fn): act's per-token-group scales
            [max_padded, I / 128] and the weight's scales [E, ceil(D / 128), I / 128], float32.
        out_dtype: the output's dtype (default act's).
        has_unrouted: some pairs are unrouted (id -1, no row): their output rows are zeros.

    Returns:
        [T, K, D] in out_dtype: row (t, k) is the weighted output of token t's k-th expert.
    """
    num_tokens, top_k = topk_weights.shape
    num_pairs = num_tokens * top_k
    hidden, inter = down_proj.shape[1:]
    num_m_blocks = alignment.expert_ids.shape[0]
    allocate = torch.zeros if has_unrouted else torch.empty  # routed rows are all written
    out = allocate(num_tokens, top_k, hidden, dtype=out_dtype or act.dtype, device=act.device)
    grid = (num_m_blocks * triton.cdiv(hidden, tiles.block_n),)
    act_scales, w_scales, *scale_strides = _scale_args(scales, act)
    _down_kernel[grid](
        act, down_proj, out, act_scales, w_scales, topk_weights.reshape(num_pairs),  # [T * K]
        alignment.sorted_ids, alignment.expert_ids, alignment.num_padded,
        num_pairs, hidden, inter, num_m_blocks,
        act.stride(0), *down_proj.stride(), out.stride(1), *scale_strides,
        BLOCK_M=alignment.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_SIZE_M=tiles.group_size_m, EVEN_K=inter % tiles.block_k == 0,
        DOT_PRECISION=_dot_precision(act.dtype), FP8=scales is not None, SWAP_AB=tiles.swap_ab,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def fused_experts_triton(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: FusedMoEConfig | None = None,
    shared_experts: int = 0,
    gate_up_scale_inv: torch.Tensor | None = None,
    down_scale_inv: torch.Tensor | None = None,
    has_unrouted: bool = False,
    x_quantized: QuantizedActivations | None = None,
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's experts e = ids_k.

    Args:
        x: [T, D] float32, float16 or bfloat16.
        gate_up_proj: [E, 2I, D] (gate rows then up rows), x's dtype, or float8_e4m3fn with
            gate_up_scale_inv [E, 2I / 128, ceil(D / 128)] float32 (`fused_experts`).
        down_proj: [E, D, I], x's dtype, or float8_e4m3fn with down_scale_inv
            [E, ceil(D / 128), I / 128] float32.
        topk_weights: [T, K] float32; topk_ids: [T, K] int64, ids in [0, E), or -1 where
            has_unrouted says so (the pair adds nothing).
        config: tiles; `moe_config` when None, chosen from the routed experts' rows (the last
            `shared_experts` experts, which every token takes, are left out of that choice).
            With FP8 weights both block_k divide 128.
        x_quantized: FP8 weights: x quantized per token and 128 columns by its producer (the
            norm before the MoE), read instead of quantizing x here.

    Returns:
        [T, D] in x's dtype. Matmuls accumulate in float32; the activation and each pair's
        weighted output are rounded to x's dtype, the sum over K accumulates in float32.
        Five launches plus the sum, no host sync (CUDA-graph capturable); with FP8 weights x
        and the activation are also quantized per token and 128-column group
        (`quantize_activations`; the activation by the gate kernel where its block_n is 128).
    """
    fp8 = check_fp8_experts(x, gate_up_proj, down_proj, gate_up_scale_inv, down_scale_inv)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up_proj.shape
    top_k = topk_ids.shape[1]
    if (gate_up_proj.shape[2] != hidden or tuple(down_proj.shape) != (num_experts, hidden,
                                                                       two_inter // 2)
            or topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape):
        raise ValueError(
            f"fused_experts_triton: x {tuple(x.shape)}, gate_up_proj "
            f"{tuple(gate_up_proj.shape)}, down_proj {tuple(down_proj.shape)}, topk_weights "
            f"{topk_weights.dtype} {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}")
    if config is None:
        config = moe_config(num_tokens * (top_k - shared_experts), num_experts - shared_experts,
                            hidden, two_inter // 2, gate_up_proj.dtype, x.device)
    if fp8 and (BLOCK_SIZE[1] % config.gate_up.block_k or BLOCK_SIZE[1] % config.down.block_k):
        raise ValueError(f"FP8 experts need block_k dividing {BLOCK_SIZE[1]} (one scale block "
                         f"per K step), not {config.gate_up.block_k} / {config.down.block_k}")
    alignment = align_by_expert(topk_ids, num_experts, config.block_m)
    if not fp8:
        act = gate_up_silu(x, gate_up_proj, alignment, top_k, config.gate_up)
        return down_weighted(act, down_proj, topk_weights, alignment, config.down,
                             has_unrouted=has_unrouted).sum(dim=1)
    if x_quantized is None:
        x_q, x_scales = quantize_activations(x)  # [T, D] fp8, [T, ceil(D / 128)]
    else:  # off CUDA the producer's values are float32, unrounded (`fp8_activations`)
        x_q, x_scales = x_quantized.values.to(FP8_DTYPE), x_quantized.scales
    in_epilogue = config.gate_up.block_n == GROUP  # the gate kernel quantizes its activation
    act = gate_up_silu(x_q, gate_up_proj, alignment, top_k, config.gate_up,
                       (x_scales, gate_up_scale_inv), act_dtype=x.dtype, quantize_act=in_epilogue)
    # [max_padded, I] fp8, [max_padded, I / 128]
    act_q, act_scales = (act.values, act.scales) if in_epilogue else quantize_activations(act)
    out = down_weighted(act_q, down_proj, topk_weights, alignment, config.down,
                        (act_scales, down_scale_inv), out_dtype=x.dtype,
                        has_unrouted=has_unrouted)  # [T, K, D]
    return out.sum(dim=1)
