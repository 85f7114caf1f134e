"""The warp-specialised (seesaw) Gluon split pass (`kernels/mla_decode/gluon_sm90.py`) without
a GPU: it compiles for sm_90 with no register spills, over 16-bit and FP8 caches, inside the
shared memory the plan's `gluon_serves` check assumes, and the plan leaves it out where it does
not apply. Its numerics are checked against the float32 reference on the GPU in
tests/kernels/test_mla_decode.py (`test_sm90_paths`) and, over an FP8 cache,
tests/kernels/test_mla_decode_fp8.py (`test_gluon_pass_over_an_fp8_cache`)."""

import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from mlaserve.kernels.mla_decode import gluon_sm90  # noqa: E402
from mlaserve.kernels.mla_decode.common import (  # noqa: E402
    GLUON_SHARED_MEMORY_LIMIT,
    GLUON_SM90,
    TRITON_SPLIT,
    gluon_serves,
    gluon_shared_memory_bytes,
)
from mlaserve.kernels.mla_decode.launch import mla_decode_triton  # noqa: E402
from mlaserve.kernels.mla_decode.plan import (  # noqa: E402
    MLADecodeConfig,
    describe,
    plan_mla_decode,
)
from mlaserve.kernels.mla_decode.tuning import GLUON_SM90_CONFIG  # noqa: E402
from tests.kernels.sm90_compile import compile_sm90  # noqa: E402


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compiles_for_sm90_without_spills(dtype: str) -> None:
    block_n, num_stages = 32, 4
    result = compile_sm90("compile_for_sm90", dtype=dtype, block_n=block_n,
                          num_stages=num_stages)
    assert result["stack"] == 0  # no register spills
    assert result["shared"] <= gluon_shared_memory_bytes(512, 64, block_n, num_stages)
    assert result["shared"] <= GLUON_SHARED_MEMORY_LIMIT
    assert "serialized" not in result["ptxas_notes"]  # the products stay asynchronous
    ptx = result["ptx"]
    # Each warpgroup computes whole S tiles (m64n32) and its half of O (m64n256); TMA loads;
    # the loader warp gives its registers to the compute partitions.
    assert "wgmma.mma_async.sync.aligned.m64n32k16" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n256k16" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx  # the output leaves by TMA
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("stages", [(3, 2), (3, 1)])
def test_compiles_for_sm90_over_an_fp8_cache_without_spills(stages: tuple[int, int],
                                                            dtype: str) -> None:
    num_stages, fp8_stages = stages
    result = compile_sm90("compile_for_sm90", dtype=dtype, block_n=32, num_stages=num_stages,
                          fp8_stages=fp8_stages)
    assert result["stack"] == 0  # no register spills
    assert result["shared"] <= gluon_shared_memory_bytes(512, 64, 32, num_stages, fp8_stages)
    assert result["shared"] <= GLUON_SHARED_MEMORY_LIMIT
    assert "serialized" not in result["ptxas_notes"]
    ptx = result["ptx"]
    # The same products, on float16 operands; FP8 tiles by TMA, two e4m3 values converted to
    # float16 an instruction, never to bfloat16 (two more slow conversions a value).
    assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "cvt.bf16.f16" not in ptx


def test_the_plan_stages_an_fp8_cache_for_the_gluon_pass_only_where_asked() -> None:
    """Over an FP8 cache the plan names the Gluon pass only with fp8_stages > 0 (the FP8
    staging ring), records the depth in the plan, and lets the 16-bit ring be odd there."""
    fp8, bf16, sm90 = torch.float8_e4m3fn, torch.bfloat16, (9, 0)
    staged = MLADecodeConfig(**dict(GLUON_SM90_CONFIG, num_stages=3, fp8_stages=2))
    plan = plan_mla_decode(32, 1280, 128, 1, 512, 64, bf16, 132, 64, config=staged,
                           capability=sm90, kv_cache_dtype=fp8)
    assert plan.kernel == GLUON_SM90 and plan.fp8_staging == 2
    assert "s3 fp8-s2" in describe(plan)
    # the same configuration over a 16-bit cache: no staging, and an odd 16-bit ring is out
    plain = plan_mla_decode(32, 1280, 128, 1, 512, 64, bf16, 132, 64, config=staged,
                            capability=sm90)
    assert plain.kernel == TRITON_SPLIT and plain.fp8_staging == 0
    unstaged = MLADecodeConfig(**GLUON_SM90_CONFIG)
    assert plan_mla_decode(32, 1280, 128, 1, 512, 64, bf16, 132, 64, config=unstaged,
                           capability=sm90, kv_cache_dtype=fp8).kernel == TRITON_SPLIT
    assert gluon_shared_memory_bytes(512, 64, 32, 3, 2) <= GLUON_SHARED_MEMORY_LIMIT
    assert not gluon_serves(sm90, bf16, 512, 64, 64, 32, 4, 64, fp8_stages=1)  # too big
    with pytest.raises(ValueError, match="fp8_stages must be >= 0"):
        MLADecodeConfig(**dict(GLUON_SM90_CONFIG, fp8_stages=-1))


def test_a_plan_for_one_cache_dtype_refuses_the_other() -> None:
    """A Gluon plan made for a 16-bit cache refuses an FP8 cache and the other way round,
    with an error that says how to plan (checked before any launch)."""
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    staged = MLADecodeConfig(**dict(GLUON_SM90_CONFIG, num_stages=3, fp8_stages=2))
    q = torch.zeros(2, 128, 576, dtype=bf16)
    table = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    for config, plan_cache, cache in ((staged, fp8, bf16),
                                      (MLADecodeConfig(**GLUON_SM90_CONFIG), None, fp8)):
        plan = plan_mla_decode(2, 64, 128, 1, 512, 64, bf16, 132, 64, config=config,
                               capability=(9, 0), kv_cache_dtype=plan_cache)
        assert plan.kernel == GLUON_SM90
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            mla_decode_triton(q, torch.zeros(1, 64, 576, dtype=cache), table, lens, 0.1, 512,
                              1, plan)


def test_stores_by_tma_only_whole_groups_that_fit_the_ring() -> None:
    stores_by_tma = gluon_sm90.stores_by_tma
    assert stores_by_tma(512, 32, 4, 128, torch.bfloat16)  # 128 heads: two whole groups
    assert stores_by_tma(512, 32, 4, 64, torch.float32)  # float32 partials fill the ring
    assert not stores_by_tma(512, 32, 4, 32, torch.bfloat16)  # 16 heads x q_len 2: padded
    assert not stores_by_tma(512, 32, 2, 64, torch.float32)  # a 2-tile ring is too small


def test_serves_sm90_shapes_only() -> None:
    sm90 = (9, 0)
    assert not gluon_serves(None, torch.bfloat16, 512, 64, 64, 32, 4, 64)  # not CUDA
    assert not gluon_serves((10, 0), torch.bfloat16, 512, 64, 64, 32, 4, 64)
    assert not gluon_serves((8, 0), torch.bfloat16, 512, 64, 64, 32, 4, 64)
    assert gluon_serves(sm90, torch.bfloat16, 512, 64, 64, 32, 4, 64)
    assert gluon_serves(sm90, torch.float16, 512, 64, 64, 32, 4, 32)
    assert not gluon_serves(sm90, torch.float32, 512, 64, 64, 32, 4, 64)
    assert not gluon_serves(sm90, torch.bfloat16, 256, 64, 64, 32, 4, 64)
    assert not gluon_serves(sm90, torch.bfloat16, 512, 32, 64, 32, 4, 64)  # R < 64
    assert not gluon_serves(sm90, torch.bfloat16, 512, 64, 32, 32, 4, 64)
    assert not gluon_serves(sm90, torch.bfloat16, 512, 64, 64, 64, 2, 64)
    assert not gluon_serves(sm90, torch.bfloat16, 512, 64, 64, 32, 4, 16)
    assert not gluon_serves(sm90, torch.bfloat16, 512, 64, 64, 32, 3, 64)
