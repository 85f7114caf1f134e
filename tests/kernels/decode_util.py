"""Shared setup of the decode-kernel tests: the device, the dtypes the interpreter runs, small
tiles, and `run_and_check` (a poisoned paged batch through the kernel, checked against the
float32 reference)."""

import math

import pytest
import torch

from mlaserve.kernels.interpreter import patch_triton_interpreter
from mlaserve.kernels.mla_decode.common import device_capability
from mlaserve.kernels.mla_decode.launch import mla_decode_triton
from mlaserve.kernels.mla_decode.plan import MLADecodeConfig, alloc_workspace, plan_mla_decode
from mlaserve.kernels.reference import mla_decode_reference
from mlaserve.kernels.testing import assert_matches_reference, poisoned_paged_batch

ON_GPU = torch.cuda.is_available()  # without it conftest.py sets TRITON_INTERPRET=1
if not ON_GPU:
    patch_triton_interpreter()

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count if ON_GPU else 4
CAPABILITY = device_capability(DEVICE)
# bfloat16 runs on the GPU only (the interpreter's bfloat16 dot is not faithful): marked gpu.
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
# Small tiles and splits, so that tiles, splits and the causal window cross page boundaries.
SMALL_TILES = MLADecodeConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, min_split_len=16)
gpu_only = pytest.mark.gpu  # skipped without CUDA (conftest.py)


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_batch(seq_lens, num_heads, kv_lora_rank, rope_dim, block_size, q_len, dtype, seed=0,
               kv_cache_dtype=None):
    """`poisoned_paged_batch` on this module's device."""
    return poisoned_paged_batch(seq_lens, num_heads, kv_lora_rank, rope_dim, block_size, q_len,
                                dtype, seed, device=DEVICE, kv_cache_dtype=kv_cache_dtype)


def check(
    o: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    q_len: int,
) -> None:
    """Compare (o, lse) with `mla_decode_reference` through the shared comparator."""
    ref_o, ref_lse = mla_decode_reference(q, kv_cache, block_table, seq_lens, softmax_scale,
                                          kv_lora_rank, q_len)
    assert_matches_reference(o, lse, ref_o, ref_lse, q.dtype)


def run_and_check(
    seq_lens: list[int],
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    block_size: int,
    q_len: int,
    dtype: torch.dtype,
    config: MLADecodeConfig | None = None,
    num_splits: int | None = None,
    seed: int = 0,
    poison_workspace: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
) -> None:
    """Run the kernel on a poisoned batch and check it; poison_workspace fills the partial
    workspace with NaN first (what the merge must never read from an empty split);
    kv_cache_dtype stores the cache in FP8, which the reference dequantizes."""
    q, kv_cache, block_table, lens = make_batch(seq_lens, num_heads, kv_lora_rank, rope_dim,
                                                block_size, q_len, dtype, seed, kv_cache_dtype)
    scale = 1.5 / math.sqrt(kv_lora_rank + rope_dim)  # peakier than 1/sqrt(192) at small sizes
    plan = plan_mla_decode(len(seq_lens), block_table.shape[1] * block_size, num_heads, q_len,
                           kv_lora_rank, rope_dim, dtype, NUM_SMS, block_size, config=config,
                           num_splits=num_splits, capability=CAPABILITY,
                           kv_cache_dtype=kv_cache_dtype)
    workspace = None
    if poison_workspace:
        workspace = alloc_workspace(plan, q.device)
        for buffer in workspace:
            buffer.fill_(float("nan"))
    o, lse = mla_decode_triton(q, kv_cache, block_table, lens, scale, kv_lora_rank, q_len,
                               plan, workspace=workspace)
    check(o, lse, q, kv_cache, block_table, lens, scale, kv_lora_rank, q_len)
