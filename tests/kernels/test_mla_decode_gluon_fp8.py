"""The FP8-cache Gluon split passes (`kernels/mla_decode/gluon_sm90_fp8.py` and
`gluon_sm90_fp8_transposed.py`) without a GPU: each compiles for sm_90 with no register
spills, inside the shared memory the plan's `gluon_fp8_serves` /
`gluon_fp8_transposed_serves` checks assume, in the way its docstring describes (the first
converts each FP8 tile once into a float16 copy read with ldmatrix; the transposed pass feeds
wgmma from registers, with no shared-memory round trip between conversion and product); and
the plan chooses each only where it applies. Their numerics are checked against the float32
reference on the GPU in tests/kernels/test_mla_decode_fp8.py (`test_gluon_fp8_pass`,
`test_gluon_fp8_transposed_pass`)."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from mlaserve.kernels.mla_decode.common import (  # noqa: E402
    GLUON_SHARED_MEMORY_LIMIT,
    GLUON_SM90_FP8,
    GLUON_SM90_FP8_T,
    TRITON_SPLIT,
    gluon_fp8_serves,
    gluon_fp8_shared_memory_bytes,
    gluon_fp8_transposed_serves,
    gluon_fp8_transposed_shared_memory_bytes,
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
    assert plan(config=replace(config, balanced_splits=True)).kernel == chosen.kernel


def test_default_config_takes_the_tuned_fp8_tile_once_one_is_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Making the FP8 Gluon pass the default for FP8 caches is one value in tuning.py; the
    plan still runs it only where it is served."""
    from mlaserve.kernels.mla_decode import tuning

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    shape = (16, 1, 512, 64, bf16, 64, 4096)
    monkeypatch.setattr(tuning, "GLUON_FP8_TRANSPOSED_STAGES", None)  # the default above it
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


@pytest.mark.parametrize("num_stages,direct_output", [(2, False), (3, True)])
def test_transposed_pass_compiles_for_sm90_as_designed(num_stages: int,
                                                       direct_output: bool) -> None:
    result = compile_sm90("compile_fp8_for_sm90", num_stages=num_stages,
                          direct_output=direct_output, transposed=True)
    assert result["stack"] == 0  # no register spills
    assert result["shared"] <= gluon_fp8_transposed_shared_memory_bytes(512, 64, num_stages)
    ptx = result["ptx"]
    assert "cp.async.bulk.tensor.2d.shared" in ptx  # FP8 tiles by TMA, from the loader warp
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t232;" in ptx  # the compute warpgroup
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    # Both products are wgmma with 16 query rows as N and the A operand in registers (a brace
    # list of registers where a shared-memory operand would be a 64-bit descriptor).
    products = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert products and all("m64n16k16.f32.f16.f16" in line for line in products)
    assert all(line.split(",")[8].strip().startswith("{") for line in products)
    assert "mma.sync" not in ptx
    assert "serialized" not in result["ptxas_notes"]  # the products stay asynchronous


def test_transposed_pass_serves_sm90_fp8_shapes_only() -> None:
    sm90, fp8, bf16 = (9, 0), torch.float8_e4m3fn, torch.bfloat16
    serves = gluon_fp8_transposed_serves
    assert serves(sm90, bf16, fp8, 16, 512, 64, 64, 2, 64)
    assert serves(sm90, torch.float16, fp8, 8, 512, 64, 64, 4, 128)
    assert not serves(None, bf16, fp8, 16, 512, 64, 64, 2, 64)  # not CUDA
    assert not serves((10, 0), bf16, fp8, 16, 512, 64, 64, 2, 64)
    assert not serves(sm90, bf16, bf16, 16, 512, 64, 64, 2, 64)  # a bf16 cache
    assert not serves(sm90, bf16, fp8, 32, 512, 64, 64, 2, 64)  # > 16 rows
    assert not serves(sm90, bf16, fp8, 16, 256, 64, 64, 2, 64)  # L != 512
    assert not serves(sm90, bf16, fp8, 16, 512, 128, 64, 2, 64)  # R != 64
    assert not serves(sm90, bf16, fp8, 16, 512, 64, 32, 2, 64)  # 32-key tiles
    assert not serves(sm90, bf16, fp8, 16, 512, 64, 64, 2, 32)  # half-tile pages
    assert not serves(sm90, bf16, fp8, 16, 512, 64, 64, 1, 64)  # no ring
    assert not serves(sm90, bf16, fp8, 16, 512, 64, 64, 6, 64)  # > 227 KB


def test_the_plan_takes_the_transposed_pass_only_where_asked_and_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlaserve.kernels.mla_decode import tuning

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    config = replace(default_config(16, 1, 512, 64, bf16, 64, 4096, 64), gluon_fp8=True,
                     fp8_transposed=True, block_n=64, num_stages=2)

    def plan(**changes):
        args = dict(batch_size=64, max_seq_len=4096, num_heads=16, q_len=1, kv_lora_rank=512,
                    qk_rope_head_dim=64, dtype=bf16, num_sms=132, block_size=64,
                    config=config, capability=(9, 0), kv_cache_dtype=fp8)
        return plan_mla_decode(**(args | changes))

    assert plan().kernel == GLUON_SM90_FP8_T
    assert describe(plan()).startswith(f"{GLUON_SM90_FP8_T} m16 n64 s2")
    assert plan(block_size=128).kernel == GLUON_SM90_FP8_T
    assert plan(kv_cache_dtype=None).kernel == TRITON_SPLIT  # a bf16 cache
    assert plan(capability=(8, 0)).kernel == TRITON_SPLIT
    assert plan(num_heads=32).kernel == TRITON_SPLIT  # 32 rows
    assert plan(config=replace(config, fp8_transposed=False)).kernel == GLUON_SM90_FP8
    # 32-key tiles: not this pass (the other FP8 pass, where asked with gluon_fp8, takes them)
    assert plan(config=replace(config, block_n=32)).kernel == GLUON_SM90_FP8
    assert plan(config=replace(config, balanced_splits=True)).kernel == GLUON_SM90_FP8_T
    # As the default: one value in tuning.py, and only where the pages are whole tiles.
    shape = (16, 1, 512, 64, bf16, 64, 4096)
    monkeypatch.setattr(tuning, "GLUON_FP8_TRANSPOSED_STAGES", None)
    assert not default_config(*shape, 64, fp8).fp8_transposed
    monkeypatch.setattr(tuning, "GLUON_FP8_TRANSPOSED_STAGES", 3)
    chosen = default_config(*shape, 64, fp8)
    assert chosen.gluon_fp8 and chosen.fp8_transposed
    assert (chosen.block_n, chosen.num_stages) == (64, 3)
    assert not default_config(*shape, 32, fp8).fp8_transposed  # pages of 32 tokens
    assert not default_config(*shape, 64).fp8_transposed  # a bf16 cache
    assert plan_mla_decode(64, 4096, 16, 1, 512, 64, bf16, 132, 64, capability=(9, 0),
                           kv_cache_dtype=fp8).kernel == GLUON_SM90_FP8_T
    # its splits count one program per SM: 2 at batch 64 (128 programs), 1 from 128 on
    assert chosen.programs_per_sm == tuning.GLUON_FP8_TRANSPOSED_PROGRAMS_PER_SM == 1.0
    for batch, splits in ((64, 2), (128, 1), (512, 1)):
        chosen_plan = plan_mla_decode(batch, 4096, 16, 1, 512, 64, bf16, 132, 64,
                                      capability=(9, 0), kv_cache_dtype=fp8)
        assert chosen_plan.num_splits == splits, batch
