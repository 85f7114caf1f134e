"""The warp-specialised (seesaw) Gluon split pass (`kernels/mla_decode/gluon_sm90.py`) without
a GPU: it compiles for sm_90 with no register spills, inside the shared memory the plan's
`gluon_serves` check assumes, and the plan leaves it out where it does not apply. Its numerics
are checked against the float32 reference on the GPU in tests/kernels/test_mla_decode.py
(`test_sm90_paths`)."""

import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from mlaserve.kernels.mla_decode import gluon_sm90  # noqa: E402
from mlaserve.kernels.mla_decode.common import (  # noqa: E402
    GLUON_SHARED_MEMORY_LIMIT,
    gluon_serves,
    gluon_shared_memory_bytes,
)
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
