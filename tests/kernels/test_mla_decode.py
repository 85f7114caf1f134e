"""The Triton paged MLA decode kernel and backend against the float32 reference
(docs/architecture.md, "Tests and benchmarks").

Without a CUDA GPU the kernels run in Triton's CPU interpreter on small shapes, in float32 and
float16 (the interpreter's bfloat16 dot is not faithful). With a GPU the same tests run natively,
in bfloat16 too, plus a grid at DeepSeek sizes. Every case poisons unused pages and the tail of
each last page with NaN and shuffles the block table.
"""

import dataclasses
import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.attention import mla_decode  # noqa: E402
from mlaserve.attention.base import MLAShape  # noqa: E402
from mlaserve.attention.triton_backend import TritonMLABackend  # noqa: E402
from mlaserve.kernels.mla_decode.common import GLUON_SM90, TRITON_SPLIT  # noqa: E402
from mlaserve.kernels.mla_decode.plan import (  # noqa: E402
    MLADecodeConfig,
    default_config,
    merge_tile,
    page_chunk,
    plan_mla_decode,
)
from tests.kernels.decode_util import (  # noqa: E402
    CAPABILITY,
    DEVICE,
    DTYPES,
    NUM_SMS,
    ON_GPU,
    SMALL_TILES,
    check,
    dtype_id,
    gpu_only,
    make_batch,
    run_and_check,
)

pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or TRITON_INTERPRET=1")

@pytest.mark.parametrize("tiling", ["small_tiles", "default"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_block_sizes_and_edge_lengths(block_size: int, dtype: torch.dtype, tiling: str) -> None:
    lens = [0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    config, splits = (SMALL_TILES, 3) if tiling == "small_tiles" else (None, None)
    run_and_check(lens, 16, 64, 16, block_size, 1, dtype, config, splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_heads", [1, 16, 128])
def test_head_counts(num_heads: int, dtype: torch.dtype, num_splits: int) -> None:
    kv_lora_rank = 32 if num_heads == 128 else 64
    run_and_check([3, 40, 77], num_heads, kv_lora_rank, 16, 16, 1, dtype, num_splits=num_splits,
                  seed=num_heads)


@pytest.mark.parametrize("tiling", ["small_tiles", "default"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_heads", [1, 16])
@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_q_len_causal(q_len: int, num_heads: int, dtype: torch.dtype, tiling: str) -> None:
    # seq_len == q_len: the request is only its new tokens; 17 and 33 put the window across
    # a page and a split boundary.
    lens = [q_len, q_len + 1, 17, 33, 45]
    config, splits = (SMALL_TILES, 3) if tiling == "small_tiles" else (None, None)
    run_and_check(lens, num_heads, 64, 16, 16, q_len, dtype, config, splits, seed=q_len)


@pytest.mark.parametrize("num_splits", [None, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_long_and_short_together(dtype: torch.dtype, num_splits: int | None) -> None:
    # Splits are sized per request: the short ones leave most of theirs empty.
    run_and_check([1500, 7, 0, 300], 16, 64, 16, 64, 1, dtype, num_splits=num_splits, seed=5)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_any_split_count_is_exact(num_splits: int) -> None:
    # Far more splits than tiles (64) is what a graph captured for long lengths sees at replay.
    run_and_check([0, 5, 100, 33], 16, 64, 16, 16, 2, torch.float32, SMALL_TILES, num_splits)


@pytest.mark.parametrize("num_splits", [7, 20])
@pytest.mark.parametrize("partial_dtype", ["float32", "input"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_empty_splits_never_read(dtype: torch.dtype, partial_dtype: str, num_splits: int) -> None:
    # Splits of >= 16 keys: the short requests leave most of theirs empty, and the merge (one
    # load per split up to 8 splits a chunk, one wide load above) must drop those without
    # taking in the NaN the workspace holds there. 16-bit partials store each split's
    # normalised output in q's dtype (float32 inputs keep float32).
    config = dataclasses.replace(SMALL_TILES, partial_dtype=partial_dtype)
    run_and_check([0, 5, 100, 33], 16, 64, 16, 16, 2, dtype, config, num_splits, seed=7,
                  poison_workspace=True)


def test_split_longer_than_one_page_chunk() -> None:
    # One split of 1500 keys in 16-token tiles is 94 tiles: page ids are read 64 at a time.
    assert page_chunk(SMALL_TILES, 1536, 1) == 64
    run_and_check([1500, 7, 0, 1025], 16, 64, 16, 32, 1, torch.float32, SMALL_TILES, 1)


def test_wide_head_group_and_tile() -> None:
    config = MLADecodeConfig(block_m=64, block_n=32, num_warps=8, num_stages=2, min_split_len=32)
    run_and_check([1, 31, 64, 97], 32, 64, 16, 32, 2, torch.float16, config, 2)


def test_merge_tile_spreads_small_batches_and_bounds_registers() -> None:
    config = default_config(16, 1, 512, 64, torch.bfloat16)
    # batch 1, 64 splits: one load per 64 splits, L cut into 8 column blocks of 64 -> 64 programs
    assert merge_tile(config, 1, 16, 64, 512) == (2, 64, 64)
    # batch 64, 4 splits: the whole L per program, as many rows as the config allows
    assert merge_tile(config, 64, 16, 4, 512) == (config.merge_block_rows, 512, 4)
    for batch, rows, splits in [(1, 128, 32), (3, 16, 7), (512, 16, 2), (1, 8, 128)]:
        block_rows, block_l, chunk = merge_tile(config, batch, rows, splits, 512)
        assert block_rows * block_l * chunk <= 8192 and 512 % block_l == 0
        assert chunk >= min(splits, 64)


def test_plan_is_host_side_and_sized() -> None:
    def plan(batch: int, max_len: int, heads: int, q_len: int = 1, block_size: int = 64,
             **kwargs):
        return plan_mla_decode(batch, max_len, heads, q_len, 512, 64, torch.bfloat16, 132,
                               block_size, **kwargs)

    big = plan(512, 1024, 16)
    assert big.num_splits == 1 and big.workspace_o_numel == 0 and big.workspace_lse_numel == 0
    # the H200 sweep: 16 rows over many long requests fill four programs per SM (2 splits here)
    assert plan(512, 4096, 16).num_splits == 2
    long = plan(1, 8192, 16)
    assert 16 <= long.num_splits <= long.config.max_num_splits
    assert -(-8192 // long.num_splits) >= long.config.min_split_len
    assert long.workspace_o_numel == long.num_splits * 16 * 512
    assert long.workspace_lse_numel == long.num_splits * 16
    # 16 rows over 32-255 requests of <= 1024 tokens: 64-token tiles, one program per SM
    short = plan(64, 1024, 16)
    assert (short.config.block_n, short.config.programs_per_sm, short.num_splits) == (64, 1.0, 2)
    assert plan(64, 2048, 16).config.block_n == 32 and plan(512, 1024, 16).config.block_n == 32
    # batch 1: the best forced split counts on the H200 (benchmarks/mla-decode-history.md)
    assert [plan(1, n, 16).num_splits for n in (1024, 4096, 8192)] == [16, 32, 64]
    # 128 heads: the seesaw pass's 64-row groups, at most 32 splits (33 beat 66 at batch 1)
    assert [plan(1, n, 128).num_splits for n in (1024, 4096, 8192)] == [16, 32, 32]
    wide = plan(64, 8192, 128)
    assert wide.num_head_groups == 2 and wide.config.block_m == 64 and wide.num_splits == 1
    lone = plan(1, 8192, 128)
    assert lone.num_head_groups == 2 and lone.config.warp_specialized
    # The plan names the kernel: the Gluon pass on sm_90 only; its tile on the Triton kernel
    # elsewhere, which loads by TMA from sm_90 on; PDL merge from sm_90 on, with splits.
    assert lone.kernel == TRITON_SPLIT and not lone.tma_loads and not lone.programmatic_launch
    hopper = plan(1, 8192, 128, capability=(9, 0))
    assert hopper.kernel == GLUON_SM90 and hopper.programmatic_launch
    assert plan(1, 8192, 128, block_size=16, capability=(9, 0)).kernel == TRITON_SPLIT
    blackwell = plan(1, 8192, 128, capability=(10, 0))
    assert blackwell.kernel == TRITON_SPLIT and blackwell.tma_loads
    assert not plan(64, 8192, 128, capability=(9, 0)).programmatic_launch  # one split
    assert plan(8, 1024, 128, q_len=2).num_head_groups == 4
    # 32 rows (16 heads x q_len 2) are padded to one 64-row seesaw program, 2 splits at 64 x 4k
    padded = plan(64, 4096, 16, q_len=2)
    assert padded.config.block_m == 64 and padded.num_splits == 2
    assert plan(64, 4096, 16, q_len=2, block_size=16).config.block_m == 32  # pages < 32 tokens
    assert plan(64, 1024, 16).config.partial_dtype == "input"  # 16-bit partials at batch 64
    assert plan(512, 4096, 16).config.partial_dtype == "float32"
    assert plan(4, 100, 16).num_splits == 1  # shorter than one minimum split
    assert plan(3, 4096, 16, num_splits=5).num_splits == 5
    fill = plan(1, 8192, 16, config=MLADecodeConfig(16, 64, 4, 2, split_policy="fill",
                                                    programs_per_sm=2.0, min_split_len=64))
    assert fill.num_splits == 128 and fill.config.min_split_len == 64
    rounded = plan(1, 8192, 16, config=MLADecodeConfig(16, 64, 4, 2, min_split_len=100))
    assert rounded.config.min_split_len == 128  # whole tiles
    with pytest.raises(ValueError):
        MLADecodeConfig(block_m=24, block_n=64, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="partial_dtype"):
        MLADecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, partial_dtype="bf16")


def test_entry_point_with_lse() -> None:
    q, kv_cache, block_table, lens = make_batch([0, 9, 50], 16, 64, 16, 16, 2, torch.float32)
    scale = 0.2
    o, lse = mla_decode(q, kv_cache, block_table, lens, scale, kv_lora_rank=64, q_len=2,
                        backend="triton", return_lse=True)
    check(o, lse, q, kv_cache, block_table, lens, scale, 64, 2)
    o_only = mla_decode(q, kv_cache, block_table, lens, scale, kv_lora_rank=64, q_len=2,
                        backend="TRITON_MLA")
    torch.testing.assert_close(o_only, o, atol=0, rtol=0)


def test_supports_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    def shape(**overrides) -> MLAShape:
        fields = dict(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, block_size=64,
                      dtype=torch.bfloat16, device=torch.device("cpu"))
        return MLAShape(**(fields | overrides))

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonMLABackend.supports(shape()) == []
    assert TritonMLABackend.capabilities.supports_cuda_graphs
    assert TritonMLABackend.auto_priority == 10
    reasons = TritonMLABackend.supports(shape(block_size=24, kv_lora_rank=48, max_q_len=9))
    assert any("block_size 24" in r for r in reasons)
    assert any("kv_lora_rank 48" in r for r in reasons)
    assert any("q_len 9" in r for r in reasons)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert TritonMLABackend.supports(shape()) == [
        "needs a CUDA GPU, or TRITON_INTERPRET=1 for the CPU interpreter"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    assert TritonMLABackend.supports(shape()) == ["triton is not installed"]


def _backend(num_heads: int, max_q_len: int, dtype: torch.dtype) -> TritonMLABackend:
    shape = MLAShape(num_heads=num_heads, kv_lora_rank=64, qk_rope_head_dim=16, block_size=16,
                     dtype=dtype, device=DEVICE, max_q_len=max_q_len)
    return TritonMLABackend(shape, softmax_scale=0.25)


def test_graph_hooks_keep_pointers_and_match_plan() -> None:
    dtype, q_len, max_blocks = torch.float32, 2, 8
    backend = _backend(16, 2, dtype)
    # Many splits even at these lengths.
    backend.config = dataclasses.replace(SMALL_TILES, split_policy="fill", programs_per_sm=8.0)
    backend.init_graph_buffers(max_batch_size=4, max_blocks_per_seq=max_blocks)
    backend.plan_for_capture(3, q_len)
    captured = backend.kernel_plan.num_splits
    assert captured > 1
    pointers = (backend.block_table.data_ptr(), backend.seq_lens.data_ptr(),
                backend.workspace[0].data_ptr(), backend.workspace[1].data_ptr())
    for seed, lens in enumerate([[2, 40, 17], [100, 3, 0]]):
        q, kv_cache, block_table, seq_lens = make_batch(lens, 16, 64, 16, 16, q_len, dtype, seed)
        backend.plan_for_replay(block_table, seq_lens, q_len)
        assert backend.kernel_plan.num_splits == captured
        assert (backend.block_table.data_ptr(), backend.seq_lens.data_ptr(),
                backend.workspace[0].data_ptr(), backend.workspace[1].data_ptr()) == pointers
        o_graph, lse_graph = backend.run(q, kv_cache, return_lse=True)
        check(o_graph, lse_graph, q, kv_cache, block_table, seq_lens, 0.25, 64, q_len)
        backend.plan(block_table, seq_lens, q_len)
        o_eager, lse_eager = backend.run(q, kv_cache, return_lse=True)
        torch.testing.assert_close(o_graph, o_eager, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse_graph, lse_eager, atol=1e-6, rtol=1e-6)
    # A smaller batch zeroes the lengths of the rows the graph still computes.
    backend.plan_for_replay(block_table[:2], seq_lens[:2], q_len)
    assert backend.graph_seq_lens[2:].count_nonzero() == 0


def test_eager_step_planned_like_a_graph() -> None:
    """A smaller eager batch runs with the captured plan of a larger graph (same compile-time
    parameters, so nothing compiles), on the static buffers, and stays exact."""
    dtype, q_len, max_blocks = torch.float32, 1, 8
    backend = _backend(16, 1, dtype)
    backend.config = dataclasses.replace(SMALL_TILES, split_policy="fill", programs_per_sm=8.0)
    backend.init_graph_buffers(max_batch_size=8, max_blocks_per_seq=max_blocks)
    backend.plan_for_capture(8, q_len)
    captured = backend.kernel_plan
    assert captured.num_splits > 1
    q, kv_cache, block_table, seq_lens = make_batch([5, 77, 30], 16, 64, 16, 16, q_len, dtype, 3)
    backend.plan(block_table, seq_lens, q_len)
    assert backend.kernel_plan != captured  # planned for 3 requests of 5 blocks
    backend.plan_like_graph(block_table, seq_lens, 8, q_len)
    assert backend.kernel_plan == captured
    assert backend.block_table.data_ptr() == backend.graph_block_table.data_ptr()
    assert backend.block_table.shape == (3, max_blocks)
    o, lse = backend.run(q, kv_cache, return_lse=True)
    check(o, lse, q, kv_cache, block_table, seq_lens, 0.25, 64, q_len)


@gpu_only
def test_cuda_graph_capture_and_replay() -> None:
    dtype, q_len, batch = torch.bfloat16, 1, 3
    backend = _backend(16, 1, dtype)
    backend.init_graph_buffers(max_batch_size=4, max_blocks_per_seq=32)
    q, kv_cache, block_table, seq_lens = make_batch([5, 200, 31], 16, 64, 16, 16, q_len, dtype)
    backend.plan_for_replay(block_table, seq_lens, q_len)
    backend.plan_for_capture(batch, q_len)
    static_q = q.clone()
    static_kv = torch.full((64, *kv_cache.shape[1:]), float("nan"), dtype=dtype, device=DEVICE)
    static_kv[: kv_cache.shape[0]].copy_(kv_cache)
    backend.run(static_q, static_kv)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o, static_lse = backend.run(static_q, static_kv, return_lse=True)
    for seed, lens in enumerate([[1, 255, 64], [0, 17, 130]]):
        q, kv_cache, block_table, seq_lens = make_batch(lens, 16, 64, 16, 16, q_len, dtype, seed)
        static_q.copy_(q)
        static_kv[: kv_cache.shape[0]].copy_(kv_cache)
        backend.plan_for_replay(block_table, seq_lens, q_len)
        graph.replay()
        check(static_o, static_lse, q, static_kv, block_table, seq_lens, 0.25, 64, q_len)


@gpu_only
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_deepseek_sizes(block_size: int, num_heads: int, dtype: torch.dtype, q_len: int) -> None:
    lens = [4096, 1, 1000, 3 * 1024 + 17, 8192 + 3, block_size + 1]
    run_and_check(lens, num_heads, 512, 64, block_size, q_len, dtype, seed=num_heads + q_len)


@gpu_only
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_large_batch_defaults(block_size: int) -> None:
    # 40 requests take the large-batch tiles (32 tokens, two KV buffers per program; 16-token
    # pages gathered row by row into them).
    lens = [(i * 997) % 5000 for i in range(40)]
    lens[:3] = [0, 1, block_size]
    run_and_check(lens, 16, 512, 64, block_size, 1, torch.bfloat16, seed=block_size)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads_and_q_len", [(128, 1), (16, 4), (64, 2), (16, 2), (16, 1)])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("path", ["tma_loads", "warp_specialized"])
def test_sm90_paths(path: str, block_size: int, heads_and_q_len: tuple[int, int],
                    num_splits: int, dtype: torch.dtype) -> None:
    # The Triton kernel with TMA tile loads (64-token tiles, the Gluon pass off, as off sm_90)
    # and the seesaw Gluon split pass: whole tiles by TMA, the partial last tile of each split
    # masked or zeroed in shared memory; odd and even tile counts, lengths that end mid-tile,
    # mid-page and on page ends, NaN in every page tail. The Gluon pass takes 64-row programs
    # (16 and 32 rows padded); the TMA flag gives the 16-row Triton programs of (16, 1) TMA
    # loads (not a default: they spill there).
    num_heads, q_len = heads_and_q_len
    lens = [4096, q_len, 1000, 3 * 1024 + 17, 2 * block_size, block_size + 1, 63 + q_len]
    changes = {"tma_loads": dict(tma_loads=True, warp_specialized=False, block_m=min(
                   64, max(16, num_heads * q_len)), block_n=64, num_stages=2),
               "warp_specialized": dict(warp_specialized=True, tma_loads=True, block_m=64,
                                        block_n=32, num_stages=4)}
    config = dataclasses.replace(
        default_config(num_heads, q_len, 512, 64, dtype, len(lens), 8192, block_size),
        **changes[path])
    planned = plan_mla_decode(len(lens), 8192, num_heads, q_len, 512, 64, dtype, NUM_SMS,
                              block_size, config=config, capability=CAPABILITY)
    if CAPABILITY == (9, 0):
        assert planned.kernel == (GLUON_SM90 if path == "warp_specialized" else TRITON_SPLIT)
    run_and_check(lens, num_heads, 512, 64, block_size, q_len, dtype, config, num_splits,
                  seed=block_size + num_heads)
