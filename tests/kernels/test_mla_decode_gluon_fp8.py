"""The FP8-cache Gluon split pass (`kernels/mla_decode/gluon_sm90_fp8.py`) without a GPU: it
compiles for sm_90 with no register spills, inside the shared memory the plan's
`gluon_fp8_serves` check assumes, converting each FP8 tile once and reading the float16 copy
with ldmatrix; and the plan chooses it only where it applies. Its numerics are checked against
the float32 reference on the GPU in tests/kernels/test_mla_decode_fp8.py
(`test_gluon_fp8_pass`)."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from mlaserve.kernels.mla_decode.common import (  # noqa: E402
    GLUON_SHARED_MEMORY_LIMIT,
    GLUON_SM90_FP8,
    TRITON_SPLIT,
    gluon_fp8_serves,
    gluon_fp8_shared_memory_bytes,
)
from mlaserve.kernels.mla_decode.plan import (  # noqa: E402
    default_config,
    describe,
    plan_mla_decode,
)
from tests.kernels.sm90_compile import compile_sm90  # noqa: E402


@pytest.mark.parametrize("block_n,num_stages", [(32, 3), (64, 2)])
def test_compiles_for_sm90_without_spills(block_n: int, num_stages: int) -> None:
    result = compile_sm90("compile_fp8_for_sm90", block_n=block_n, num_stages=num_stages)
    assert result["stack"] == 0  # no register spills
    assert result["shared"] <= gluon_fp8_shared_memory_bytes(512, 64, block_n, num_stages)
    assert result["shared"] <= GLUON_SHARED_MEMORY_LIMIT
    ptx = result["ptx"]
    assert "cp.async.bulk.tensor.2d.shared" in ptx  # FP8 tiles by TMA
    assert "cvt.rn.f16x2.e4m3x2" in ptx  # converted two values an instruction
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    # both products read the float16 copy with ldmatrix, transposed for P V
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx


def test_serves_sm90_fp8_shapes_only() -> None:
    sm90, fp8, bf16 = (9, 0), torch.float8_e4m3fn, torch.bfloat16
    assert gluon_fp8_serves(sm90, bf16, fp8, 16, 512, 64, 32, 3, 64)
    assert gluon_fp8_serves(sm90, torch.float16, fp8, 8, 512, 64, 64, 2, 64)
    assert not gluon_fp8_serves(None, bf16, fp8, 16, 512, 64, 32, 3, 64)  # not CUDA
    assert not gluon_fp8_serves((10, 0), bf16, fp8, 16, 512, 64, 32, 3, 64)
    assert not gluon_fp8_serves(sm90, bf16, bf16, 16, 512, 64, 32, 3, 64)  # a bf16 cache
    assert not gluon_fp8_serves(sm90, torch.float32, fp8, 16, 512, 64, 32, 3, 64)
    assert not gluon_fp8_serves(sm90, bf16, fp8, 32, 512, 64, 32, 3, 64)  # > 16 rows
    assert not gluon_fp8_serves(sm90, bf16, fp8, 16, 256, 64, 32, 3, 64)  # L != 512
    assert not gluon_fp8_serves(sm90, bf16, fp8, 16, 512, 128, 32, 3, 64)  # R != 64
    assert not gluon_fp8_serves(sm90, bf16, fp8, 16, 512, 64, 64, 2, 32)  # tile > page
    assert not gluon_fp8_serves(sm90, bf16, fp8, 16, 512, 64, 32, 1, 64)  # no ring
    assert not gluon_fp8_serves(sm90, bf16, fp8, 16, 512, 64, 16, 4, 64)  # 16 keys: warps repeat
    assert not gluon_fp8_serves(sm90, bf16, fp8, 16, 512, 64, 64, 4, 64)  # too much memory


def test_the_plan_takes_it_only_where_asked_and_served() -> None:
    config = replace(default_config(16, 1, 512, 64, torch.bfloat16, 64, 4096, 64),
                     gluon_fp8=True, block_n=32, num_stages=3)

    def plan(**changes):
        args = dict(batch_size=64, max_seq_len=4096, num_heads=16, q_len=1, kv_lora_rank=512,
                    qk_rope_head_dim=64, dtype=torch.bfloat16, num_sms=132, block_size=64,
                    config=config, capability=(9, 0), kv_cache_dtype=torch.float8_e4m3fn)
        return plan_mla_decode(**(args | changes))

    chosen = plan()
    assert chosen.kernel == GLUON_SM90_FP8 and not chosen.tma_loads
    assert describe(chosen).startswith(f"{GLUON_SM90_FP8} m16 n32 s3")
    assert "fp16-dots" not in describe(chosen)  # a flag of the Triton pass
    assert plan(kv_cache_dtype=None).kernel == TRITON_SPLIT  # a bf16 cache
    assert plan(capability=(8, 0)).kernel == TRITON_SPLIT
    assert plan(num_heads=32).kernel == TRITON_SPLIT  # 32 rows
    assert plan(config=replace(config, gluon_fp8=False)).kernel == TRITON_SPLIT
    assert plan(config=replace(config, split_policy="balanced")).kernel == TRITON_SPLIT


def test_default_config_takes_the_tuned_fp8_tile_once_one_is_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Making the FP8 Gluon pass the default for FP8 caches is one value in tuning.py; the
    plan still runs it only where it is served."""
    from mlaserve.kernels.mla_decode import tuning

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    shape = (16, 1, 512, 64, bf16, 64, 4096)
    monkeypatch.setattr(tuning, "GLUON_FP8_TILE", None)
    assert not default_config(*shape, 64, fp8).gluon_fp8
    monkeypatch.setattr(tuning, "GLUON_FP8_TILE", (32, 3))
    config = default_config(*shape, 64, fp8)
    assert config.gluon_fp8 and (config.block_n, config.num_stages) == (32, 3)
    assert not default_config(*shape, 64).gluon_fp8  # a bf16 cache
    assert not default_config(*shape, 16, fp8).gluon_fp8  # a tile would straddle pages
    assert not default_config(128, 1, 512, 64, bf16, 64, 4096, 64, fp8).gluon_fp8  # 128 rows
    chosen = plan_mla_decode(64, 4096, 16, 1, 512, 64, bf16, 132, 64, capability=(9, 0),
                             kv_cache_dtype=fp8)
    assert chosen.kernel == GLUON_SM90_FP8
    off_sm90 = plan_mla_decode(64, 4096, 16, 1, 512, 64, bf16, 132, 64, capability=(8, 0),
                               kv_cache_dtype=fp8)
    assert off_sm90.kernel == TRITON_SPLIT and off_sm90.config.block_n == 32
