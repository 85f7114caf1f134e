"""Stage 2 of the paged MLA decode: the log-sum-exp merge of the split pass's partial outputs
(`triton_split.py`, or the Gluon pass of `gluon_sm90.py`).

`_mla_decode_merge_kernel`: per block of output rows, merge the splits' partial (o, lse) by
log-sum-exp, a chunk of splits at a time; empty splits (whose partial output was never stored)
get weight 0 and never reach the sum. With one split, stage 1 writes the final
output directly and stage 2 is not launched. Partial outputs are float32, or q's dtype where
the configuration asks (`MLADecodeConfig.partial_dtype`); LSEs are always float32.

On sm_90 and newer the merge kernel is a programmatic dependent launch: it is scheduled while the
split pass runs and waits (griddepcontrol.wait) for its completion and stores.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from mlaserve.kernels.mla_decode.plan import MLADecodePlan


@triton.jit
def _mla_decode_merge_kernel(
    partial_o_ptr,  # [B, num_splits, q_len * H, L] float32
    partial_lse_ptr,  # [B, num_splits, q_len * H] float32
    o_ptr,  # [B, q_len * H, L] q dtype
    lse_ptr,  # [B, q_len * H] float32
    num_rows,  # q_len * H
    num_splits,
    KV_LORA_RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Log-sum-exp merge of BLOCK_R output rows x BLOCK_L columns, SPLIT_CHUNK splits per load.

    One pass with a running maximum: each iteration loads the LSEs [SPLIT_CHUNK, BLOCK_R] of a
    chunk of splits and their partial outputs, none of those loads waiting on another. Up to 8
    splits a chunk, one [BLOCK_R, BLOCK_L] load per split, so the sum over splits stays inside
    each thread; more splits (batch 1) take one wide [SPLIT_CHUNK, BLOCK_R, BLOCK_L] load, so
    the merge waits on a few loads instead of one per split. The column blocks (grid axis 2)
    spread a small batch's merge over more SMs.
    """
    if USE_PDL:
        gdc_wait()  # launched before the split pass ended: wait for it and its stores
    row_block = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    col_block = tl.program_id(2)
    rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    offs_l = col_block * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_s = tl.arange(0, SPLIT_CHUNK)
    split_base = req * num_splits

    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    weight_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_L], dtype=tl.float32)
    for first in range(0, num_splits, SPLIT_CHUNK):
        splits = first + offs_s  # [SPLIT_CHUNK]
        valid = (splits < num_splits)[:, None] & row_mask[None, :]  # [SPLIT_CHUNK, BLOCK_R]
        flat = (split_base + splits)[:, None] * num_rows + rows[None, :]
        lse_chunk = tl.load(partial_lse_ptr + flat, mask=valid, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse_chunk, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split with a key yet
        weight = tl.exp(lse_chunk - m_safe[None, :])  # [SPLIT_CHUNK, BLOCK_R]; 0 when empty
        rescale = tl.exp(m - m_safe)  # [BLOCK_R]
        acc = acc * rescale[:, None]
        if SPLIT_CHUNK <= 8:
            # One [BLOCK_R, BLOCK_L] load per split, none waiting on another: the sum over
            # splits stays inside each thread (a 3-d load of 16-bit partials puts warps on the
            # split axis and sums through shared memory).
            for s in tl.static_range(SPLIT_CHUNK):
                weight_s = tl.sum(tl.where((offs_s == s)[:, None], weight, 0.0), 0)  # [BLOCK_R]
                row_s = (split_base + first + s) * num_rows + rows  # [BLOCK_R]
                # Empty splits (weight 0) never stored a partial: not loaded (zeros).
                part = tl.load(partial_o_ptr + row_s[:, None] * KV_LORA_RANK + offs_l[None, :],
                               mask=(row_mask & (weight_s > 0.0))[:, None]
                               & (first + s < num_splits), other=0.0)
                acc += weight_s[:, None] * part.to(tl.float32)
        else:  # many splits (small batches): one wide load, empty splits masked off
            part = tl.load(partial_o_ptr + flat[:, :, None] * KV_LORA_RANK
                           + offs_l[None, None, :], mask=(weight > 0.0)[:, :, None],
                           other=0.0).to(tl.float32)  # [SPLIT_CHUNK, BLOCK_R, BLOCK_L]
            acc += tl.sum(weight[:, :, None] * part, 0)
        weight_sum = weight_sum * rescale + tl.sum(weight, 0)
        m = m_new

    no_key = weight_sum == 0.0  # every split was empty
    weight_sum = tl.where(no_key, 1.0, weight_sum)
    out = acc / weight_sum[:, None]
    lse = tl.where(no_key, float("-inf"), m + tl.log(weight_sum))
    out_offs = (req * num_rows + rows)[:, None] * KV_LORA_RANK + offs_l[None, :]
    tl.store(o_ptr + out_offs, out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])
    tl.store(lse_ptr + req * num_rows + rows, lse, mask=row_mask & (col_block == 0))


def launch_merge(
    plan: MLADecodePlan,
    partial_o: torch.Tensor,
    partial_lse: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    batch: int,
    num_rows: int,
    kv_lora_rank: int,
) -> None:
    """Stage 2 (`_mla_decode_merge_kernel`) with the plan's merge tile: partial_o
    [B, num_splits, q_len * H, L] and partial_lse [B, num_splits, q_len * H] (flat) into
    o [B * q_len, H, L] (q dtype) and lse [B * q_len, H] float32; num_rows = q_len * H."""
    block_rows, block_l = plan.merge_block_rows, plan.merge_block_l
    grid = (triton.cdiv(num_rows, block_rows), batch, kv_lora_rank // block_l)
    _mla_decode_merge_kernel[grid](
        partial_o, partial_lse, o, lse, num_rows, plan.num_splits,
        KV_LORA_RANK=kv_lora_rank, BLOCK_R=block_rows, BLOCK_L=block_l,
        SPLIT_CHUNK=plan.merge_split_chunk, USE_PDL=plan.programmatic_launch,
        num_warps=plan.config.merge_num_warps, launch_pdl=plan.programmatic_launch,
    )


__all__ = ["launch_merge"]
