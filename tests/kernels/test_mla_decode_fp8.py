"""The Triton decode kernel over FP8 (float8_e4m3fn) latent caches, and with the latent in
column chunks (`MLADecodeConfig.latent_chunks`), against the float32 reference that reads the
same cache (docs/architecture.md, "Tests and benchmarks"). Without a CUDA GPU in Triton's CPU
interpreter (float32 and float16); every batch poisons unused pages and page tails with NaN.
"""

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels.mla_decode.plan import (  # noqa: E402
    default_config,
    describe,
    plan_mla_decode,
)
from tests.kernels.decode_util import (  # noqa: E402
    CAPABILITY,
    DTYPES,
    NUM_SMS,
    ON_GPU,
    SMALL_TILES,
    dtype_id,
    gpu_only,
    run_and_check,
)

pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or TRITON_INTERPRET=1")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size", [16, 64])
def test_fp8_cache_matches_the_reference_of_the_same_cache(block_size: int,
                                                           dtype: torch.dtype) -> None:
    """An FP8 (float8_e4m3fn) cache read with queries in dtype: every FP8 value is exact in
    dtype, so the kernel is held to dtype's own bounds against the float32 reference that
    dequantizes the same cache (NaN page tails and stale pages included)."""
    lens = [0, 1, block_size - 1, 3 * block_size + 5, 300]
    run_and_check(lens, 16, 64, 16, block_size, 1, dtype, SMALL_TILES, 3,
                  kv_cache_dtype=torch.float8_e4m3fn)
    run_and_check(lens, 16, 64, 16, block_size, 2, dtype, kv_cache_dtype=torch.float8_e4m3fn)


def test_bfloat16_queries_over_an_fp8_cache_take_float16_dots() -> None:
    """The plan runs a bfloat16 q over an FP8 cache with float16 dots (one conversion
    instruction per two FP8 values); q is rounded to float16 once, so the output is held to
    bfloat16's bounds against the float32 reference of the same cache (on CPU too: the
    interpreter's float16 dots are faithful)."""
    plan = plan_mla_decode(4, 512, 16, 1, 64, 16, torch.bfloat16, NUM_SMS, 16,
                           kv_cache_dtype=torch.float8_e4m3fn)
    assert plan.fp16_dots and "fp16-dots" in describe(plan)
    assert not plan_mla_decode(4, 512, 16, 1, 64, 16, torch.bfloat16, NUM_SMS, 16).fp16_dots
    lens = [0, 1, 15, 53, 300]
    run_and_check(lens, 16, 64, 16, 16, 1, torch.bfloat16, SMALL_TILES, 3,
                  kv_cache_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("kv_cache_dtype", [None, torch.float8_e4m3fn], ids=["same", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_latent_in_column_chunks(dtype: torch.dtype, kv_cache_dtype: torch.dtype | None) -> None:
    """latent_chunks = 4: q, each KV tile and the accumulator as 4 column chunks of the latent
    (batched dots over the chunks), with q_len 2 and several splits, against the float32
    reference; a chunk computed with another chunk's columns, or a dropped chunk, fails."""
    config = dataclasses.replace(SMALL_TILES, latent_chunks=4)
    lens = [0, 1, 15, 53, 300]
    run_and_check(lens, 16, 64, 16, 16, 2, dtype, config, 3, kv_cache_dtype=kv_cache_dtype)
    with pytest.raises(ValueError, match="latent_chunks 8 must leave chunks of at least 16"):
        plan_mla_decode(1, 64, 16, 1, 64, 16, dtype, NUM_SMS, 16,
                        config=dataclasses.replace(SMALL_TILES, latent_chunks=8))
    with pytest.raises(ValueError, match="latent_chunks must be a power of two"):
        dataclasses.replace(SMALL_TILES, latent_chunks=3)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("latent_chunks", [1, 4])
@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("q_len", [1, 2])
def test_fp8_cache_tma_loads(q_len: int, block_n: int, latent_chunks: int,
                             dtype: torch.dtype) -> None:
    # An FP8 cache read by TMA into the 16-row Triton pass (2-d boxes, or 3-d [block_n, C,
    # L / C] boxes with the latent in chunks), the partial last tile by masked loads, NaN in
    # every page tail; held to dtype's bounds against the reference of the same cache.
    lens = [4096, q_len, 1000, 3 * 1024 + 17, 128, 65, 63 + q_len]
    config = dataclasses.replace(
        default_config(16, q_len, 512, 64, dtype, len(lens), 8192, 64), tma_loads=True,
        block_n=block_n, num_stages=4, latent_chunks=latent_chunks)
    planned = plan_mla_decode(len(lens), 8192, 16, q_len, 512, 64, dtype, NUM_SMS, 64,
                              config=config, capability=CAPABILITY,
                              kv_cache_dtype=torch.float8_e4m3fn)
    assert planned.tma_loads == (CAPABILITY >= (9, 0))
    run_and_check(lens, 16, 512, 64, 64, q_len, dtype, config, 3, seed=block_n + q_len,
                  kv_cache_dtype=torch.float8_e4m3fn)


def test_wide_rows_over_an_fp8_cache_take_the_gluon_pass_with_staged_fp8_tiles() -> None:
    """More than 16 query rows over an FP8 cache (128 heads, or 16 heads x q_len 2) with
    pages of 32 or more tokens: the 64-row Gluon pass with 2 FP8 tiles staged and 3 converted
    tiles in its ring on sm_90 (float16 products for a bfloat16 q); elsewhere the Triton pass
    with the same tile."""
    from mlaserve.kernels.mla_decode.common import GLUON_SM90, TRITON_SPLIT

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    for heads, q_len in ((128, 1), (16, 2)):
        for block_size in (32, 64):
            config = default_config(heads, q_len, 512, 64, bf16, 32, 1280, block_size, fp8)
            assert (config.block_m, config.block_n, config.num_stages) == (64, 32, 3)
            assert config.warp_specialized and config.fp8_stages == 2 and not config.gluon_fp8
            plan = plan_mla_decode(32, 1280, heads, q_len, 512, 64, bf16, 132, block_size,
                                   capability=(9, 0), kv_cache_dtype=fp8)
            assert plan.kernel == GLUON_SM90 and plan.fp8_staging == 2 and plan.fp16_dots
        elsewhere = plan_mla_decode(32, 1280, heads, q_len, 512, 64, bf16, 132, 64,
                                    capability=(10, 0), kv_cache_dtype=fp8)
        assert elsewhere.kernel == TRITON_SPLIT and elsewhere.fp8_staging == 0
    bf16_cache = default_config(128, 1, 512, 64, bf16, 32, 1280, 64)
    assert bf16_cache.warp_specialized and bf16_cache.fp8_stages == 0
    assert plan_mla_decode(32, 1280, 128, 1, 512, 64, bf16, 132, 64,
                           capability=(9, 0)).fp8_staging == 0


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("heads_and_q_len", [(128, 1), (16, 2)])
def test_wide_rows_over_an_fp8_cache(heads_and_q_len: tuple[int, int],
                                     dtype: torch.dtype) -> None:
    # The planned configuration for more than 16 rows over an FP8 cache (the 64-row Gluon
    # pass with FP8 tiles staged on sm_90), with one split and several, against the reference
    # of the same cache; NaN in every page tail.
    heads, q_len = heads_and_q_len
    lens = [1280, q_len, 1000, 3 * 64 + 17, 65]
    run_and_check(lens, heads, 512, 64, 64, q_len, dtype, seed=heads + q_len,
                  kv_cache_dtype=torch.float8_e4m3fn)
    run_and_check(lens, heads, 512, 64, 64, q_len, dtype, num_splits=3, seed=heads,
                  kv_cache_dtype=torch.float8_e4m3fn)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("stages", [(3, 2), (3, 1), (2, 2)])
@pytest.mark.parametrize("partial_dtype", ["float32", "input"])
@pytest.mark.parametrize("heads_and_q_len", [(128, 1), (16, 2), (16, 3)])
@pytest.mark.parametrize("block_size", [32, 64])
def test_gluon_pass_over_an_fp8_cache(block_size: int, heads_and_q_len: tuple[int, int],
                                      partial_dtype: str, stages: tuple[int, int],
                                      dtype: torch.dtype) -> None:
    # The 64-row Gluon pass over an FP8 cache: FP8 tiles staged by TMA, converted to float16
    # by the converter warps into the ring the seesaw warpgroups read (an odd ring too), 128
    # rows (two whole groups, the output by TMA) and 32 / 48 rows (a padded group), one
    # split and three, partials in float32 and in q's dtype, NaN in every page tail and in
    # the workspace, a request with no keys; against the float32 reference of the same cache.
    num_heads, q_len = heads_and_q_len
    num_stages, fp8_stages = stages
    lens = [1280, q_len, 0, 1000, 3 * 64 + 17, 2 * block_size, block_size + 1, 63 + q_len]
    config = dataclasses.replace(
        default_config(num_heads, q_len, 512, 64, dtype, len(lens), 8192, block_size),
        num_stages=num_stages, fp8_stages=fp8_stages, partial_dtype=partial_dtype)
    planned = plan_mla_decode(len(lens), 8192, num_heads, q_len, 512, 64, dtype, NUM_SMS,
                              block_size, config=config, capability=CAPABILITY,
                              kv_cache_dtype=torch.float8_e4m3fn)
    if CAPABILITY == (9, 0):
        assert planned.kernel == "gluon_sm90" and planned.fp8_staging == fp8_stages
    for num_splits in (1, 3):
        run_and_check(lens, num_heads, 512, 64, block_size, q_len, dtype, config, num_splits,
                      seed=num_heads + block_size, poison_workspace=True,
                      kv_cache_dtype=torch.float8_e4m3fn)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads_and_q_len", [(16, 1), (8, 2), (5, 3)])
@pytest.mark.parametrize("tiles", [(32, 3), (64, 2)])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("partial_dtype", ["float32", "input"])
def test_gluon_fp8_pass(partial_dtype: str, block_size: int, tiles: tuple[int, int],
                        heads_and_q_len: tuple[int, int], num_splits: int,
                        dtype: torch.dtype) -> None:
    # The Gluon pass over an FP8 cache (`gluon_sm90_fp8.py`): tiles by TMA, each converted
    # once to float16 in shared memory (a partial last tile's rows past the split zeroed
    # there), up to 16 rows (heads x q_len, causal), NaN in every page tail and unused page,
    # a request with no keys, partials in float32 and in q's dtype, and a NaN-filled
    # workspace (empty splits' partials must never be read); against the float32 reference
    # of the same cache, to dtype's bounds.
    num_heads, q_len = heads_and_q_len
    block_n, num_stages = tiles
    lens = [4096, q_len, 1000, 0, 3 * 1024 + 17, 2 * block_size, block_size + 1, 63 + q_len]
    config = dataclasses.replace(
        default_config(num_heads, q_len, 512, 64, dtype, len(lens), 8192, block_size),
        gluon_fp8=True, block_n=block_n, num_stages=num_stages, partial_dtype=partial_dtype)
    planned = plan_mla_decode(len(lens), 8192, num_heads, q_len, 512, 64, dtype, NUM_SMS,
                              block_size, config=config, capability=CAPABILITY,
                              kv_cache_dtype=torch.float8_e4m3fn)
    if CAPABILITY == (9, 0):
        assert planned.kernel == "gluon_sm90_fp8"
    run_and_check(lens, num_heads, 512, 64, block_size, q_len, dtype, config, num_splits,
                  seed=block_size + num_heads, poison_workspace=True,
                  kv_cache_dtype=torch.float8_e4m3fn)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads_and_q_len", [(16, 1), (8, 2), (5, 3)])
@pytest.mark.parametrize("block_size,num_stages", [(64, 2), (128, 3)])
@pytest.mark.parametrize("partial_dtype", ["float32", "input"])
def test_gluon_fp8_transposed_pass(partial_dtype: str, block_size: int, num_stages: int,
                                   heads_and_q_len: tuple[int, int], num_splits: int,
                                   dtype: torch.dtype) -> None:
    # The transposed Gluon pass over an FP8 cache (`gluon_sm90_fp8_transposed.py`): 64-key
    # tiles by TMA from a loader warp, both products with the query rows as wgmma's N and the
    # FP8 tile converted in registers (a partial last tile's keys past the split zeroed
    # there), the latent columns of O^T put back in order at the store; up to 16 rows (heads x
    # q_len, causal), NaN in every page tail and unused page, a request with no keys, partials
    # in float32 and in q's dtype, and a NaN-filled workspace; against the float32 reference
    # of the same cache, to dtype's bounds (a column of O^T stored at another column's place,
    # or a dropped key, fails them).
    num_heads, q_len = heads_and_q_len
    lens = [4096, q_len, 1000, 0, 3 * 1024 + 17, 2 * block_size, block_size + 1, 63 + q_len]
    config = dataclasses.replace(
        default_config(num_heads, q_len, 512, 64, dtype, len(lens), 8192, block_size),
        gluon_fp8=True, fp8_transposed=True, block_n=64,
        num_stages=num_stages, partial_dtype=partial_dtype)
    planned = plan_mla_decode(len(lens), 8192, num_heads, q_len, 512, 64, dtype, NUM_SMS,
                              block_size, config=config, capability=CAPABILITY,
                              kv_cache_dtype=torch.float8_e4m3fn)
    if CAPABILITY == (9, 0):
        assert planned.kernel == "gluon_sm90_fp8_transposed"
    run_and_check(lens, num_heads, 512, 64, block_size, q_len, dtype, config, num_splits,
                  seed=block_size + num_heads + num_stages, poison_workspace=True,
                  kv_cache_dtype=torch.float8_e4m3fn)

