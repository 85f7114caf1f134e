"""The warp-specialised (seesaw) Gluon split pass (`kernels/mla_decode/gluon_sm90.py`) without
a GPU: it compiles for sm_90 with no register spills, inside the shared memory the plan's
`gluon_serves` check assumes, and the plan leaves it out where it does not apply. Its numerics
are checked against the float32 reference on the GPU in tests/kernels/test_mla_decode.py
(`test_sm90_paths`)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from mlaserve.kernels.mla_decode import gluon_sm90  # noqa: E402
from mlaserve.kernels.mla_decode.common import (  # noqa: E402
    GLUON_SHARED_MEMORY_LIMIT,
    gluon_serves,
    gluon_shared_memory_bytes,
)

# Runs in a fresh interpreter: the CPU test session interprets Triton kernels
# (TRITON_INTERPRET=1 is read when triton and gluon decorate their functions).
_COMPILE = """
import json, os, subprocess, sys, tempfile
import torch, triton
from mlaserve.kernels.mla_decode.gluon_sm90_aot import compile_for_sm90
dtype, block_n, num_stages = getattr(torch, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
compiled = compile_for_sm90(dtype=dtype, block_n=block_n, num_stages=num_stages)
tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(compiled.asm["cubin"]); f.flush()
    usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                           text=True, check=True).stdout
line = next(line for line in usage.splitlines() if "STACK:" in line)
print(json.dumps({"stack": int(line.split("STACK:")[1].split()[0]),
                  "shared": compiled.metadata.shared, "ptx": compiled.asm["ptx"]}))
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compiles_for_sm90_without_spills(dtype: str) -> None:
    block_n, num_stages = 32, 4
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, dtype, str(block_n), str(num_stages)],
                         capture_output=True, text=True, env=env, check=True).stdout
    result = json.loads(out.splitlines()[-1])
    assert result["stack"] == 0  # no register spills
    assert result["shared"] <= gluon_shared_memory_bytes(512, 64, block_n, num_stages)
    assert result["shared"] <= GLUON_SHARED_MEMORY_LIMIT
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
