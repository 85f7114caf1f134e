"""Balanced splits: the split length planned on the device from the batch's actual lengths.

The plan's grid bounds the splits per request; once a step `launch.plan_split_len` picks the
least split length L (`split_plan.py`: the waves model over the real lengths), so short
batches are not cut for the bound's length and a ragged batch's long requests take more splits
than its short ones, under one grid. Checked against the float32 reference (one dropped key
fails), with NaN in every page tail and in the workspace, and by reading which splits wrote a
partial LSE: on the CPU through the Triton pass and the backend's step and graph hooks, on an
H100/H200 through every split pass.
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
from mlaserve.kernels.mla_decode.launch import mla_decode_triton, plan_split_len  # noqa: E402
from mlaserve.kernels.mla_decode.plan import (  # noqa: E402
    MLADecodePlan,
    alloc_workspace,
    default_config,
    describe,
    plan_mla_decode,
)
from mlaserve.kernels.mla_decode.split_plan import NUM_CANDIDATES  # noqa: E402
from mlaserve.kernels.mla_decode.tuning import BALANCED_GRID_PROGRAMS_PER_SLOT  # noqa: E402
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


def split_lens(lens: list[int], plan: MLADecodePlan, least: int) -> list[int]:
    """Each request's split length under a least length (common.py's arithmetic)."""
    tile = plan.config.block_n
    return [max(least, -(-max(-(-n // plan.num_splits), 1) // tile) * tile) for n in lens]


def wanted_splits(lens: list[int], plan: MLADecodePlan, least: int) -> list[int]:
    """Splits with keys per request under a least split length."""
    return [-(-n // per) for n, per in zip(lens, split_lens(lens, plan, least), strict=True)]


def modelled_split_len(lens: list[int], plan: MLADecodePlan) -> int:
    """split_plan.py's choice, written out on the host: the candidate L of least waves x
    (longest program + overhead), the first among equals."""
    tile, grid = plan.config.block_n, plan.num_splits
    total, busy = sum(lens), max(1, sum(n > 0 for n in lens))
    best = None
    for i in range(NUM_CANDIDATES):
        s = min((1 << (i // 2)) * (14142 if i % 2 else 10000) // 10000, grid)
        least = max(math.ceil(math.ceil(total / (busy * s)) / tile) * tile,
                    plan.config.min_split_len)
        pers = split_lens(lens, plan, least)
        programs = sum(-(-n // per) for n, per in zip(lens, pers, strict=True))
        longest = max(min(n, per) for n, per in zip(lens, pers, strict=True))
        waves = -(-programs * plan.num_head_groups // plan.split_slots)
        cost = waves * (longest + plan.split_overhead)
        if best is None or cost < best[0]:
            best = (cost, least)
    return best[1]


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


def test_the_grid_bounds_the_splits_and_the_device_plans_their_length() -> None:
    """The plan's grid holds at least BALANCED_GRID_PROGRAMS_PER_SLOT programs per slot (no
    more splits than the bound's length can use); the device's choice follows the lengths:
    a uniform batch of short requests keeps one split each whatever the bound, a lone long
    request is cut to the least split length, and a ragged batch gets the length of least
    modelled makespan."""
    bf16 = torch.bfloat16

    def plan(batch: int, bound: int, heads: int = 16, balanced: bool = True) -> MLADecodePlan:
        config = dataclasses.replace(default_config(heads, 1, 512, 64, bf16, batch, bound, 64),
                                     balanced_splits=balanced)
        return plan_mla_decode(batch, bound, heads, 1, 512, 64, bf16, 132, 64, config=config,
                               capability=(9, 0))

    # what a server's graphs planned for 8192 tokens run without it (benchmarks/mla-decode):
    # every request cut into 9 splits at 232 requests, into 1 at 256, whatever their lengths
    assert plan(232, 8192, balanced=False).num_splits == 9
    assert plan(256, 8192, balanced=False).num_splits == 1
    wide = plan(232, 8192)
    assert wide.split_slots == 264 and wide.split_overhead > 0
    assert wide.num_splits * 232 >= BALANCED_GRID_PROGRAMS_PER_SLOT * 264
    assert " balanced 264 slots " in describe(wide)
    assert plan(1, 8192).num_splits == min(plan(1, 8192).config.max_num_splits, 8192 // 128)
    cases = [(wide, [1500] * 200 + [0] * 32), (plan(1, 8192), [8192]),
             (plan(64, 8192), [(i * 977) % 8192 + 1 for i in range(64)]),
             (plan(16, 8192, heads=128), [64, 8192, 3000, 1] * 4)]
    for planned, lens in cases:
        got = plan_split_len(planned, torch.tensor(lens, dtype=torch.int32, device=DEVICE))
        assert got.tolist() == [modelled_split_len(lens, planned)], lens[:4]
        splits = wanted_splits(lens, planned, got.item())
        if planned is wide:
            assert set(splits) == {0, 1}  # 200 x 1500 keys: not cut for the 8192 bound
        if len(lens) == 1:
            assert splits == [8192 // planned.config.min_split_len]


def test_the_split_plan_compiles_for_sm90() -> None:
    """The device's split plan compiles for sm_90 without a GPU, one program without spills."""
    result = compile_sm90("compile_for_sm90", module="mlaserve.kernels.mla_decode.split_plan")
    assert result["stack"] == 0
    assert "st.global" in result["ptx"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_balanced_splits_give_long_requests_more_of_the_grid(dtype: torch.dtype) -> None:
    """A ragged batch's long request takes more splits than its short ones, and every key is
    still attended once."""
    lens = [1, 700, 13, 0, 256, 64]
    config = dataclasses.replace(SMALL_TILES, balanced_splits=True, max_num_splits=64)
    q, kv_cache, block_table, seq_lens = make_batch(lens, 16, 64, 16, 16, 1, dtype)
    plan = plan_mla_decode(len(lens), block_table.shape[1] * 16, 16, 1, 64, 16, dtype, NUM_SMS,
                           16, config=config, capability=CAPABILITY)
    assert plan.kernel == TRITON_SPLIT and plan.split_slots > 0 and plan.num_splits > 1
    workspace = poisoned_workspace(plan)
    scale = 1.5 / math.sqrt(64 + 16)
    o, lse = mla_decode_triton(q, kv_cache, block_table, seq_lens, scale, 64, 1, plan,
                               workspace=workspace)
    check(o, lse, q, kv_cache, block_table, seq_lens, scale, 64, 1)
    least = plan_split_len(plan, seq_lens).item()
    used = used_splits(workspace, plan, len(lens), 16)
    assert used == wanted_splits(lens, plan, least)
    assert used[1] > used[4] >= used[0] == used[2] == 1 and used[3] == 0


@pytest.mark.parametrize("least", [0, 1, 10**6])
def test_any_split_length_only_moves_split_boundaries(least: int) -> None:
    """The split length is a hint (one planned for another moment of the step is what a
    pipelined step may read): zero, one key, or far too long, every key is attended once."""
    lens = [1, 300, 0, 77]
    config = dataclasses.replace(SMALL_TILES, balanced_splits=True, max_num_splits=16)
    q, kv_cache, block_table, seq_lens = make_batch(lens, 16, 64, 16, 16, 1, torch.float32, 5)
    plan = plan_mla_decode(len(lens), block_table.shape[1] * 16, 16, 1, 64, 16, torch.float32,
                           NUM_SMS, 16, config=config, capability=CAPABILITY)
    workspace = poisoned_workspace(plan)
    given = torch.tensor([least], dtype=torch.int32, device=DEVICE)
    o, lse = mla_decode_triton(q, kv_cache, block_table, seq_lens, 0.25, 64, 1, plan,
                               workspace=workspace, split_len=given)
    check(o, lse, q, kv_cache, block_table, seq_lens, 0.25, 64, 1)
    if least == 10**6:  # a split as long as the grid allows: one split a request
        assert used_splits(workspace, plan, len(lens), 16) == [1, 1, 0, 1]


def test_the_backend_plans_the_split_length_once_a_step_and_graphs_read_a_static_one() -> None:
    """`plan()` plans the step's split length; under CUDA graphs `plan_for_replay()` and
    `plan_like_graph()` plan it into the static buffer the captured kernels read, for the
    replaying graph's grid."""
    dtype = torch.float32
    shape = MLAShape(num_heads=16, kv_lora_rank=64, qk_rope_head_dim=16, block_size=16,
                     dtype=dtype, device=DEVICE, max_q_len=1)
    backend = TritonMLABackend(shape, softmax_scale=0.25)
    backend.config = dataclasses.replace(SMALL_TILES, balanced_splits=True)
    lens = [3, 120, 0, 41]
    q, kv_cache, block_table, seq_lens = make_batch(lens, 16, 64, 16, 16, 1, dtype, 1)
    backend.plan(block_table, seq_lens)
    assert backend.kernel_plan.split_slots > 0
    assert backend.split_len.tolist() == [modelled_split_len(lens, backend.kernel_plan)]
    o, lse = backend.run(q, kv_cache, return_lse=True)
    check(o, lse, q, kv_cache, block_table, seq_lens, 0.25, 64, 1)

    backend.init_graph_buffers(max_batch_size=6, max_blocks_per_seq=block_table.shape[1])
    backend.plan_for_capture(4)
    static = backend.split_len
    for seed, lens in enumerate([[90, 1, 17, 0], [5, 6, 7, 128]]):
        q, kv_cache, block_table, seq_lens = make_batch(lens, 16, 64, 16, 16, 1, dtype, seed)
        backend.plan_for_replay(block_table, seq_lens, graph_batch_size=4)
        graph_plan = backend._make_plan(4, backend._graph_max_seq_len, 1)
        assert backend.split_len is static
        assert static.tolist() == [modelled_split_len(lens, graph_plan)]
        o, lse = backend.run(q, kv_cache, return_lse=True)
        check(o, lse, q, kv_cache, block_table, seq_lens, 0.25, 64, 1)
    backend.plan_like_graph(block_table[:2], seq_lens[:2], 6)
    graph_plan = backend._make_plan(6, backend._graph_max_seq_len, 1)
    assert backend.split_len is static
    assert static.tolist() == [modelled_split_len([5, 6], graph_plan)]
    o, lse = backend.run(q[:2], kv_cache, return_lse=True)
    check(o, lse, q[:2], kv_cache, block_table[:2], seq_lens[:2], 0.25, 64, 1)


@pytest.mark.parametrize("function,kwargs", [
    ("compile_for_sm90", dict(block_n=32, num_stages=4)),
    ("compile_for_sm90", dict(block_n=32, num_stages=3, fp8_stages=2)),
    ("compile_fp8_for_sm90", dict(block_n=32, num_stages=3)),
    ("compile_fp8_for_sm90", dict(num_stages=2, transposed=True)),
], ids=["gluon_sm90", "gluon_sm90_fp8_staged", "gluon_sm90_fp8", "gluon_sm90_fp8_transposed"])
def test_every_gluon_pass_compiles_for_sm90_with_the_split_length(function: str,
                                                              kwargs: dict) -> None:
    """Each Gluon pass reads the step's split length (one scalar load) and still compiles for
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
    workspace): each pass cuts them at the device's split length and matches the float32
    reference of the same cache."""
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
    assert plan.num_splits > 1 and plan.split_slots > 0
    workspace = poisoned_workspace(plan)
    scale = 1 / math.sqrt(512 + 64)
    least = plan_split_len(plan, seq_lens)
    assert least.tolist() == [modelled_split_len(lens, plan)]
    o, lse = mla_decode_triton(q, kv_cache, block_table, seq_lens, scale, 512, 1, plan,
                               workspace=workspace, split_len=least)
    check(o, lse, q, kv_cache, block_table, seq_lens, scale, 512, 1)
    used = used_splits(workspace, plan, len(lens), num_heads)
    assert used == wanted_splits(lens, plan, least.item())
    assert used[0] > used[3] >= used[1] == 1 and used[2] == 0
