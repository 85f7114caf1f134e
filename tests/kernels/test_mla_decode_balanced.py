"""Balanced splits: split lengths from the batch's actual keys, on the device.

The plan makes a grid of BALANCED_HEADROOM x the uniform split count S; each split is at least
the batch's keys over B x S long (`launch.sum_keys` sums them once a step), so a ragged
batch's long requests take more splits and its short ones fewer, under one grid. Checked
against the float32 reference (one dropped key fails), with NaN in every page tail and in the
workspace, and by reading which splits wrote a partial LSE: on the CPU through the Triton pass
and the backend's step and graph hooks, on an H100/H200 through every split pass.
"""

import dataclasses
import math
import os

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.attention.base import MLAShape  # noqa: E402
from mlaserve.attention.triton_backend import TritonMLABackend  # noqa: E402
from mlaserve.kernels.mla_decode.common import (  # noqa: E402
    GLUON_SM90,
    GLUON_SM90_FP8,
    GLUON_SM90_FP8_T,
    TRITON_SPLIT,
)
from mlaserve.kernels.mla_decode.launch import mla_decode_triton  # noqa: E402
from mlaserve.kernels.mla_decode.plan import (  # noqa: E402
    MLADecodePlan,
    alloc_workspace,
    default_config,
    describe,
    plan_mla_decode,
)
from mlaserve.kernels.mla_decode.tuning import BALANCED_HEADROOM  # noqa: E402
from tests.kernels.decode_util import (  # noqa: E402
    CAPABILITY,
    DEVICE,
    NUM_SMS,
    ON_GPU,
    SMALL_TILES,
    check,
    dtype_id,
    gpu_only,
    make_batch,
)
from tests.kernels.sm90_compile import compile_sm90  # noqa: E402

pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or TRITON_INTERPRET=1")


def wanted_splits(lens: list[int], plan: MLADecodePlan) -> list[int]:
    """Splits with keys per request under the policy (common.py's arithmetic, on the host)."""
    tile, least = plan.config.block_n, plan.config.min_split_len
    balanced_len = -(-sum(lens) // plan.balance_splits)
    split_lens = [max(least, -(-max(-(-n // plan.num_splits), balanced_len) // tile) * tile)
                  for n in lens]
    return [-(-n // split_len) for n, split_len in zip(lens, split_lens, strict=True)]


def used_splits(workspace: tuple[torch.Tensor, torch.Tensor], plan: MLADecodePlan,
                batch: int, rows: int) -> list[int]:
    """Splits per request that wrote a finite partial LSE into the NaN-filled workspace."""
    partial_lse = workspace[1][:batch * plan.num_splits * rows].view(batch, plan.num_splits,
                                                                     rows)
    return torch.isfinite(partial_lse[:, :, 0]).sum(dim=1).tolist()


def poisoned_workspace(plan: MLADecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
    workspace = alloc_workspace(plan, DEVICE)
    for buffer in workspace:
        buffer.fill_(float("nan"))
    return workspace


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_balanced_splits_give_long_requests_more_of_the_grid(dtype: torch.dtype) -> None:
    """A ragged batch's long request takes more than S splits and short ones fewer, and every
    key is still attended once."""
    lens = [1, 700, 13, 0, 256, 64]
    config = dataclasses.replace(SMALL_TILES, balanced_splits=True, max_num_splits=64)
    q, kv_cache, block_table, seq_lens = make_batch(lens, 16, 64, 16, 16, 1, dtype)
    plan = plan_mla_decode(len(lens), block_table.shape[1] * 16, 16, 1, 64, 16, dtype, NUM_SMS,
                           16, config=config, capability=CAPABILITY)
    uniform_splits = plan.balance_splits // len(lens)
    assert plan.kernel == TRITON_SPLIT and uniform_splits >= 1
    assert plan.num_splits == min(64, BALANCED_HEADROOM * uniform_splits)
    assert f"(waves balanced keys/{plan.balance_splits} " in describe(plan)
    workspace = poisoned_workspace(plan)
    scale = 1.5 / math.sqrt(64 + 16)
    o, lse = mla_decode_triton(q, kv_cache, block_table, seq_lens, scale, 64, 1, plan,
                               workspace=workspace)
    check(o, lse, q, kv_cache, block_table, seq_lens, scale, 64, 1)
    used = used_splits(workspace, plan, len(lens), 16)
    assert used == wanted_splits(lens, plan)
    assert used[1] > uniform_splits and used[0] == used[2] == 1 and used[3] == 0


@pytest.mark.parametrize("total", [0, 1, 10**6])
def test_any_key_count_only_moves_split_boundaries(total: int) -> None:
    """The key count is a hint (a bound from earlier in the step is what a pipelined step
    has): too small, a count of one, or far too large, every key is attended once."""
    lens = [1, 300, 0, 77]
    config = dataclasses.replace(SMALL_TILES, balanced_splits=True, max_num_splits=16)
    q, kv_cache, block_table, seq_lens = make_batch(lens, 16, 64, 16, 16, 1, torch.float32, 5)
    plan = plan_mla_decode(len(lens), block_table.shape[1] * 16, 16, 1, 64, 16, torch.float32,
                           NUM_SMS, 16, config=config, capability=CAPABILITY)
    workspace = poisoned_workspace(plan)
    keys = torch.tensor([total], dtype=torch.int32, device=DEVICE)
    o, lse = mla_decode_triton(q, kv_cache, block_table, seq_lens, 0.25, 64, 1, plan,
                               workspace=workspace, total_keys=keys)
    check(o, lse, q, kv_cache, block_table, seq_lens, 0.25, 64, 1)
    if total == 10**6:  # a split as long as the grid allows: one split a request
        assert used_splits(workspace, plan, len(lens), 16) == [1, 1, 0, 1]


def test_the_backend_sums_the_keys_once_a_step_and_graphs_read_a_static_count() -> None:
    """`plan()` sums the step's keys; under CUDA graphs `plan_for_replay()` and
    `plan_like_graph()` sum them into the static buffer the captured kernels read."""
    dtype = torch.float32
    shape = MLAShape(num_heads=16, kv_lora_rank=64, qk_rope_head_dim=16, block_size=16,
                     dtype=dtype, device=DEVICE, max_q_len=1)
    backend = TritonMLABackend(shape, softmax_scale=0.25)
    backend.config = dataclasses.replace(SMALL_TILES, balanced_splits=True)
    lens = [3, 120, 0, 41]
    q, kv_cache, block_table, seq_lens = make_batch(lens, 16, 64, 16, 16, 1, dtype, 1)
    backend.plan(block_table, seq_lens)
    assert backend.kernel_plan.balance_splits > 0
    assert backend.total_keys.tolist() == [sum(lens)]
    o, lse = backend.run(q, kv_cache, return_lse=True)
    check(o, lse, q, kv_cache, block_table, seq_lens, 0.25, 64, 1)

    backend.init_graph_buffers(max_batch_size=6, max_blocks_per_seq=block_table.shape[1])
    backend.plan_for_capture(4)
    static_keys = backend.total_keys
    for seed, lens in enumerate([[90, 1, 17, 0], [5, 6, 7, 128]]):
        q, kv_cache, block_table, seq_lens = make_batch(lens, 16, 64, 16, 16, 1, dtype, seed)
        backend.plan_for_replay(block_table, seq_lens)
        assert backend.total_keys is static_keys and static_keys.tolist() == [sum(lens)]
        o, lse = backend.run(q, kv_cache, return_lse=True)
        check(o, lse, q, kv_cache, block_table, seq_lens, 0.25, 64, 1)
    backend.plan_like_graph(block_table[:2], seq_lens[:2], 6)
    assert backend.total_keys is static_keys and static_keys.tolist() == [5 + 6]
    o, lse = backend.run(q[:2], kv_cache, return_lse=True)
    check(o, lse, q[:2], kv_cache, block_table[:2], seq_lens[:2], 0.25, 64, 1)


@pytest.mark.parametrize("function,kwargs", [
    ("compile_for_sm90", dict(block_n=32, num_stages=4)),
    ("compile_for_sm90", dict(block_n=32, num_stages=3, fp8_stages=2)),
    ("compile_fp8_for_sm90", dict(block_n=32, num_stages=3)),
    ("compile_fp8_for_sm90", dict(num_stages=2, transposed=True)),
], ids=["gluon_sm90", "gluon_sm90_fp8_staged", "gluon_sm90_fp8", "gluon_sm90_fp8_transposed"])
def test_every_gluon_pass_compiles_for_sm90_with_the_key_count(function: str,
                                                              kwargs: dict) -> None:
    """Each Gluon pass reads the step's key count (one scalar load) and still compiles for
    sm_90 without register spills (no GPU needed)."""
    result = compile_sm90(function, balanced=True, **kwargs)
    assert result["stack"] == 0
    plain = compile_sm90(function, **kwargs)
    assert result["ptx"].count("ld.global") == plain["ptx"].count("ld.global") + 1


# Each split pass of sm_90 with the policy: (heads, cache dtype, config changes, kernel).
_FP8 = torch.float8_e4m3fn
SM90_PASSES = {
    "triton": (16, None, dict(warp_specialized=False, tma_loads=True), TRITON_SPLIT),
    "warp_specialized": (16, None, dict(warp_specialized=True, tma_loads=True, block_m=64,
                                        block_n=32, num_stages=4), GLUON_SM90),
    "fp8_staged": (128, _FP8, dict(), GLUON_SM90),
    "gluon_fp8": (16, _FP8, dict(gluon_fp8=True, fp8_transposed=False, block_n=32,
                                 num_stages=3), GLUON_SM90_FP8),
    "fp8_transposed": (16, _FP8, dict(gluon_fp8=True, fp8_transposed=True, block_n=64,
                                      num_stages=2), GLUON_SM90_FP8_T),
}


@gpu_only
@pytest.mark.parametrize("path", list(SM90_PASSES))
def test_every_split_pass_takes_balanced_splits(path: str) -> None:
    """Requests of 0, 1 and 8192 keys side by side (pages of 64, NaN in every tail and in the
    workspace): each pass cuts them as the policy says and matches the float32 reference of
    the same cache."""
    num_heads, cache_dtype, changes, kernel = SM90_PASSES[path]
    dtype, block_size = torch.bfloat16, 64
    lens = [8192, 1, 0, 700, 4096 + 17, 64, 33, 2048]
    q, kv_cache, block_table, seq_lens = make_batch(lens, num_heads, 512, 64, block_size, 1,
                                                    dtype, 7, kv_cache_dtype=cache_dtype)
    bound = block_table.shape[1] * block_size
    config = dataclasses.replace(
        default_config(num_heads, 1, 512, 64, dtype, len(lens), bound, block_size, cache_dtype),
        balanced_splits=True, **changes)
    plan = plan_mla_decode(len(lens), bound, num_heads, 1, 512, 64, dtype, NUM_SMS, block_size,
                           config=config, capability=CAPABILITY, kv_cache_dtype=cache_dtype)
    if CAPABILITY == (9, 0):
        assert plan.kernel == kernel, describe(plan)
    assert plan.num_splits > 1 and plan.balance_splits > 0
    workspace = poisoned_workspace(plan)
    scale = 1 / math.sqrt(512 + 64)
    o, lse = mla_decode_triton(q, kv_cache, block_table, seq_lens, scale, 512, 1, plan,
                               workspace=workspace)
    check(o, lse, q, kv_cache, block_table, seq_lens, scale, 512, 1)
    used = used_splits(workspace, plan, len(lens), num_heads)
    assert used == wanted_splits(lens, plan)
    assert used[0] > used[3] >= used[1] == 1 and used[2] == 0
