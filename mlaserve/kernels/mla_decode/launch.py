"""`mla_decode_triton`: the paged MLA decode launch, which obeys its plan (`plan.py`).

The plan names the split pass (`TRITON_SPLIT` or a Gluon pass) and every compile-time parameter;
this module only checks that the tensors are what the plan assumes, allocates what is missing,
and launches the split pass, then the merge kernel when there is more than one split. It never
synchronises with the device.
"""

import functools
import importlib
from collections.abc import Callable

import torch

from mlaserve.kernels.mla_decode import merge
from mlaserve.kernels.mla_decode.common import (
    GLUON_SM90,
    GLUON_SM90_FP8,
    GLUON_SM90_FP8_T,
    LOG2E,
    SplitPassIO,
)
from mlaserve.kernels.mla_decode.plan import MLADecodePlan, partial_dtype_of
from mlaserve.kernels.mla_decode.split_plan import launch_split_len

_GLUON_PASSES = (GLUON_SM90, GLUON_SM90_FP8, GLUON_SM90_FP8_T)


@functools.cache
def _split_pass(kernel: str) -> Callable[[MLADecodePlan, SplitPassIO], None]:
    """The launcher of the pass named `kernel`: `launch_split_pass` of the module of that name,
    imported the first time a plan names it (the Gluon passes need Gluon)."""
    return importlib.import_module(f"{__package__}.{kernel}").launch_split_pass


def _check_pow2(name: str, value: int, minimum: int) -> None:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def _pages_back_to_back(kv_cache: torch.Tensor) -> bool:
    """Whether the cache's rows form one [num_blocks * block_size, L + R] matrix."""
    return kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1)


def _check_layout(plan: MLADecodePlan, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Raise where the cache's layout cannot serve the plan's TMA loads (the plan is made from
    shapes only; every cache the engine allocates has its pages back to back)."""
    head_dim = q.shape[-1]
    needs = []
    if plan.kernel in _GLUON_PASSES or plan.tma_loads:
        if not _pages_back_to_back(kv_cache):
            needs.append("kv_cache pages back to back")
        if kv_cache.data_ptr() % 16:
            needs.append("a 16-byte aligned kv_cache")
    if plan.kernel in _GLUON_PASSES and kv_cache.stride(1) != head_dim:
        needs.append("kv_cache rows of exactly L + R elements")
    if needs:
        raise ValueError(f"the plan's {plan.kernel} kernel"
                         f"{' with TMA loads' if plan.tma_loads else ''} needs "
                         + ", ".join(needs))


def plan_split_len(plan: MLADecodePlan, seq_lens: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The step's least split length under balanced splits (`plan.split_slots`), planned on the
    device from the [B] int32 seq_lens (`split_plan.py`): [1] int32, into `out` where given (a
    static buffer for CUDA graphs). One small launch, no synchronisation; run it once a step
    and hand the result to every layer's `mla_decode_triton`."""
    if out is None:
        out = torch.empty(1, dtype=torch.int32, device=seq_lens.device)
    launch_split_len(seq_lens, out, plan.num_splits, plan.num_head_groups, plan.split_slots,
                     plan.split_overhead, plan.config.min_split_len, plan.config.block_n)
    return out


def mla_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    q_len: int,
    plan: MLADecodePlan,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    split_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode (split-KV + merge) as planned; launches one or two kernels, never syncs.

    Args:
        q: [B * q_len, H, L + R] absorbed queries `[q_latent | q_pe]`, request-major rows;
            bfloat16, float16 or float32; the last dim contiguous.
        kv_cache: [num_blocks, block_size, L + R] latent cache `[c_kv | k_pe]` in q's dtype or
            float8_e4m3fn (converted to q's dtype in the split pass), the last dim
            contiguous; block_size a power of two. Where the plan loads tiles by TMA
            (`plan.tma_loads`, or the Gluon pass) its pages must lie back to back.
        block_table: [B, max_blocks] int32 page ids per request (entries past a request's
            length are never read).
        seq_lens: [B] int32 KV length per request including the q_len new tokens; 0 allowed.
        softmax_scale: multiplies q.k before the softmax.
        kv_lora_rank: L (a power of two >= 16); R = q.shape[-1] - L (a power of two >= 16).
        q_len: new tokens per request, causal among themselves.
        plan: from `plan_mla_decode`: the kernel, the split count, the configuration and every
            other compile-time parameter of the launch (any plan is correct for any lengths
            and batch; one made for other sizes only costs speed).
        workspace: (partial_o, partial_lse) float32 buffers of at least the plan's sizes, from
            `alloc_workspace` (partial_o is viewed as q's dtype for 16-bit partials); allocated
            here when None. Unused with one split.
        split_len: [1] int32 on q's device, the step's least split length under balanced
            splits (`plan.split_slots`), from `plan_split_len`; planned here when None. Any
            value gives correct outputs (it only moves split boundaries), so one planned from
            an earlier moment of the step (or for another plan of it) is fine.

    Returns:
        o: [B * q_len, H, L] in q's dtype (zero for rows that see no key).
        lse: [B * q_len, H] float32, natural log (-inf for rows that see no key).
    """
    num_tokens, num_heads, head_dim = q.shape
    batch = block_table.shape[0]
    block_size = kv_cache.shape[1]
    if num_tokens != batch * q_len:
        raise ValueError(f"q has {num_tokens} rows, expected B * q_len = {batch} * {q_len}")
    if kv_cache.shape[2] != head_dim or kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match q "
                         f"{tuple(q.shape)} {q.dtype} (the cache is in q's dtype or FP8)")
    if kv_cache.dtype != q.dtype and plan.kernel == GLUON_SM90 and not plan.fp8_staging:
        raise ValueError("an FP8 cache needs a plan made with kv_cache_dtype=float8_e4m3fn "
                         "(this plan's Gluon pass reads a 16-bit cache)")
    fp8_pass = plan.kernel in (GLUON_SM90_FP8, GLUON_SM90_FP8_T) or plan.fp8_staging > 0
    if fp8_pass and kv_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"the plan's {plan.kernel} pass reads an FP8 cache, got "
                         f"{kv_cache.dtype}: plan with kv_cache_dtype={kv_cache.dtype}")
    _check_pow2("kv_lora_rank", kv_lora_rank, 16)
    _check_pow2("qk_rope_head_dim", head_dim - kv_lora_rank, 16)
    _check_pow2("block_size", block_size, 1)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    if plan.kernel == GLUON_SM90 and (not q.is_contiguous() or q.data_ptr() % 16):
        q = q.clone(memory_format=torch.contiguous_format)  # the pass reads q by TMA
    _check_layout(plan, q, kv_cache)
    block_table = block_table.to(torch.int32)
    seq_lens = seq_lens.to(torch.int32)
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()

    o = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return o, lse
    num_splits = plan.num_splits
    rows = q_len * num_heads
    if num_splits == 1:
        partial_o, partial_lse = o, lse  # [B, 1, q_len * H, L] and [B, 1, q_len * H] views
    else:
        o_numel = batch * num_splits * rows * kv_lora_rank
        lse_numel = batch * num_splits * rows
        partial_dtype = partial_dtype_of(plan.config, q.dtype)
        if workspace is None:
            workspace = (torch.empty(o_numel, dtype=partial_dtype, device=q.device),
                         torch.empty(lse_numel, dtype=torch.float32, device=q.device))
        partial_o, partial_lse = workspace
        if partial_o.dtype != partial_dtype:  # float32 storage viewed as 16-bit partials
            partial_o = partial_o.view(partial_dtype)
        if partial_o.numel() < o_numel or partial_lse.numel() < lse_numel:
            raise ValueError(f"workspace too small: need {o_numel} {partial_dtype} partial "
                             f"outputs and {lse_numel} float32 LSEs, got {partial_o.numel()} and "
                             f"{partial_lse.numel()}")
    if plan.split_slots and split_len is None:
        split_len = plan_split_len(plan, seq_lens)
    io = SplitPassIO(q, kv_cache, block_table, seq_lens, partial_o, partial_lse,
                     softmax_scale * LOG2E, kv_lora_rank, q_len,
                     split_len if plan.split_slots else None)
    _split_pass(plan.kernel)(plan, io)
    if num_splits > 1:
        merge.launch_merge(plan, partial_o, partial_lse, o, lse, batch, rows, kv_lora_rank)
    return o, lse


__all__ = ["mla_decode_triton", "plan_split_len"]
