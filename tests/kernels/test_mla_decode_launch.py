"""Each Gluon split pass's launcher against its kernel, without a GPU.

`mla_decode_triton` runs a plan made for sm_90 on CPU tensors with the planned pass's kernel
replaced by a recorder, which binds the launch's arguments to the kernel's own parameters (a
missing, extra or misnamed argument fails the bind) and keeps them; the tests check the values
that come from the plan and the tensors: the grid, the split count and length, the page size,
the ring depth, q's strides and the descriptors' boxes. The kernels' numerics are checked on the
GPU against the float32 reference (tests/kernels/test_mla_decode.py, test_mla_decode_fp8.py).
"""

import inspect
import math

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from mlaserve.kernels.mla_decode import merge  # noqa: E402
from mlaserve.kernels.mla_decode.common import (  # noqa: E402
    GLUON_SM90,
    GLUON_SM90_FP8,
    GLUON_SM90_FP8_T,
    LOG2E,
)
from mlaserve.kernels.mla_decode.launch import mla_decode_triton  # noqa: E402
from mlaserve.kernels.mla_decode.plan import plan_mla_decode  # noqa: E402

KV_LORA_RANK, ROPE_DIM, NUM_SMS = 512, 64, 132
# the launch options Triton takes beside the kernel's own parameters
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` binds the arguments to the
    kernel's parameters and keeps (grid, {name: value}, launch options)."""

    def __init__(self, kernel) -> None:
        self.signature = inspect.signature(kernel.fn)
        self.calls: list[tuple[tuple, dict, dict]] = []

    def __getitem__(self, grid: tuple):
        def launch(*args, **kwargs) -> None:
            options = {name: kwargs.pop(name) for name in LAUNCH_OPTIONS if name in kwargs}
            bound = self.signature.bind(*args, **kwargs)
            self.calls.append((grid, dict(bound.arguments), options))
        return launch


def _launch(monkeypatch, module_name: str, kernel_name: str, *, heads: int, batch: int,
            kv_len: int, block_size: int, cache_dtype: torch.dtype):
    """Plans for sm_90 and launches through `mla_decode_triton` with the pass's kernel recorded;
    returns (plan, the one recorded call, q, seq_lens)."""
    module = pytest.importorskip(f"mlaserve.kernels.mla_decode.{module_name}")
    recorder = _Recorder(getattr(module, kernel_name))
    monkeypatch.setattr(module, kernel_name, recorder)
    merges = []  # the merge kernel's launch (compiled for sm_90: no interpreter run here)
    monkeypatch.setattr(merge, "launch_merge", lambda plan, *args: merges.append(args))
    plan = plan_mla_decode(batch, kv_len, heads, 1, KV_LORA_RANK, ROPE_DIM, torch.bfloat16,
                           NUM_SMS, block_size, capability=(9, 0), kv_cache_dtype=cache_dtype)
    pages = -(-kv_len // block_size)
    q = torch.zeros(batch, heads, KV_LORA_RANK + ROPE_DIM, dtype=torch.bfloat16)
    kv_cache = torch.zeros(batch * pages, block_size, KV_LORA_RANK + ROPE_DIM, dtype=cache_dtype)
    block_table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)  # [B, pages]
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32)
    mla_decode_triton(q, kv_cache, block_table, seq_lens, 0.1, KV_LORA_RANK, 1, plan)
    assert len(recorder.calls) == 1
    assert len(merges) == (plan.num_splits > 1)
    return plan, recorder.calls[0], q, seq_lens


def _check_common(plan, args: dict, seq_lens: torch.Tensor, block_size: int) -> None:
    assert args["seq_lens_ptr"] is seq_lens
    assert args["q_len"] == 1
    assert args["num_splits"] == plan.num_splits
    assert args["min_split_len"] == plan.config.min_split_len
    assert math.isclose(args["qk_scale"], 0.1 * LOG2E)
    assert args["BLOCK_SIZE"] == block_size
    assert args["NUM_STAGES"] == plan.config.num_stages
    assert args["DIRECT_OUTPUT"] == (plan.num_splits == 1)


def test_gluon_sm90_launch(monkeypatch) -> None:
    plan, (grid, args, options), q, seq_lens = _launch(
        monkeypatch, "gluon_sm90", "_mla_decode_split_kernel_sm90", heads=128, batch=4,
        kv_len=1024, block_size=64, cache_dtype=torch.bfloat16)
    assert plan.kernel == GLUON_SM90
    assert grid == (2, plan.num_splits, 4)  # 128 query rows in programs of 64
    _check_common(plan, args, seq_lens, 64)
    boxes = [list(args[name].block_shape)
             for name in ("q_nope_desc", "q_pe_desc", "kv_nope_desc", "kv_pe_desc", "o_desc")]
    block_n = plan.config.block_n
    assert boxes == [[64, KV_LORA_RANK], [64, ROPE_DIM], [block_n, KV_LORA_RANK],
                     [block_n, ROPE_DIM], [64, KV_LORA_RANK // 2]]
    assert options["num_warps"] == 4


@pytest.mark.parametrize("block_size,module_name,kernel_name,kernel", [
    (32, "gluon_sm90_fp8", "_mla_decode_split_kernel_sm90_fp8", GLUON_SM90_FP8),
    (64, "gluon_sm90_fp8_transposed", "_mla_decode_split_kernel_sm90_fp8_transposed",
     GLUON_SM90_FP8_T),
])
def test_gluon_fp8_launch(monkeypatch, block_size: int, module_name: str, kernel_name: str,
                          kernel: str) -> None:
    plan, (grid, args, _), q, seq_lens = _launch(
        monkeypatch, module_name, kernel_name, heads=16, batch=8, kv_len=4096,
        block_size=block_size, cache_dtype=torch.float8_e4m3fn)
    assert plan.kernel == kernel
    assert grid == (1, plan.num_splits, 8)  # one program of 16 rows per (split, request)
    _check_common(plan, args, seq_lens, block_size)
    assert args["q_ptr"] is q
    assert (args["stride_q_token"], args["stride_q_head"]) == (q.stride(0), q.stride(1))
    assert list(args["kv_desc"].block_shape) == [plan.config.block_n, 128]
    assert list(args["pe_desc"].block_shape) == [plan.config.block_n, ROPE_DIM]
