"""`mlaserve bench moe --sweep` with FP8 experts, on the CPU (Triton's interpreter, a tiny
shape): every candidate the sweep tries computes the w8a8 output within the reference's bound
(as stored, transposed, with the activation quantized in the gate kernel's epilogue or by a
launch of its own), and the configuration it returns is one of them. The timer is replaced by
a deterministic stand-in; GPU timings come from `mlaserve bench moe` itself."""

import os

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.bench import moe_sweep  # noqa: E402
from mlaserve.bench.moe_cases import MoEShape, check, make_case  # noqa: E402
from mlaserve.kernels.fp8_blocks import quantize_block_fp8  # noqa: E402
from mlaserve.kernels.fused_moe import fused_experts_triton  # noqa: E402
from mlaserve.kernels.fused_moe_config import FusedMoEConfig  # noqa: E402
from mlaserve.kernels.moe import fused_experts_w8a8_reference  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or TRITON_INTERPRET=1")


def test_fp8_candidates_stay_in_a_scale_block_and_block_m_follows_the_rows():
    for block_m in moe_sweep.SWEEP_BLOCK_M:
        candidates = moe_sweep._candidates(block_m, fp8=True)
        assert all(128 % tiles.block_k == 0 for tiles in candidates)
        assert {tiles.swap_ab for tiles in candidates} == {False, True}
        assert any(tiles.block_n == 128 for tiles in candidates)  # the epilogue's quantization
    assert moe_sweep._block_ms(0.1) == [16]  # one token: 16-row blocks only
    assert moe_sweep._block_ms(24) == [16, 32, 64]
    assert moe_sweep._block_ms(768) == [64, 128]  # prefill: no blocks under 64 rows


def test_fp8_sweep_checks_every_candidate_and_returns_one(monkeypatch):
    shape = MoEShape(hidden=256, inter=128, num_experts=4, top_k=2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    gate_up, gate_up_scales = quantize_block_fp8(
        torch.randn(4, 256, 256, generator=gen) / 16)
    down, down_scales = quantize_block_fp8(torch.randn(4, 256, 128, generator=gen) / 11)
    case = make_case(shape, 3, [gate_up.to(device)], [down.to(device)],
                     (gate_up_scales.to(device), down_scales.to(device)), device)
    case.x = case.x.float()  # the interpreter's bfloat16 casts truncate
    case.ref = fused_experts_w8a8_reference(case.x, case.gate_up[0], case.down[0],
                                            case.topk_weights, case.topk_ids, *case.scales)
    timed, configs = [], []

    def fake_seconds(call, num_copies, calls, replays):  # one call each, a distinct time
        call(0)
        timed.append(len(timed))
        return 1.0 / len(timed)

    def fake_time_config(case, config, calls, replays):
        configs.append(config)
        passed, rel_err, cos_gap = check(case, fused_experts_triton(
            case.x, topk_weights=case.topk_weights, topk_ids=case.topk_ids, config=config,
            **case.weights(0)))
        assert passed, (config, rel_err, cos_gap)
        return 1.0 / (1 + len(configs))

    monkeypatch.setattr(moe_sweep, "graph_seconds", fake_seconds)
    monkeypatch.setattr(moe_sweep, "time_config", fake_time_config)
    best = moe_sweep.sweep(case, calls=1, replays=1)
    candidates = moe_sweep._candidates(16, fp8=True)
    assert len(timed) == 2 * len(candidates)  # none failed its check: each kernel's all timed
    assert isinstance(best["config"], FusedMoEConfig) and best["config"] in configs[1:]
    assert best["config"].gate_up in candidates and best["config"].down in candidates


def test_write_tuned_merges_into_the_file_the_engine_reads(monkeypatch, tmp_path):
    """A second sweep over other T adds its entries and replaces those of the T it swept; the
    file loads as `moe_config`'s table."""
    from mlaserve.kernels import fused_moe_config

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Test GPU 1")
    first, second = (fused_moe_config.default_config(n, 4, torch.float8_e4m3fn) for n in (6, 4096))
    entry = dict(us=1.0, default_us=2.0)
    moe_sweep.write_tuned(tmp_path, (4, 256, 128), torch.float8_e4m3fn,
                          [dict(tokens=1, num_pairs=6, config=first, **entry),
                           dict(tokens=8, num_pairs=48, config=first, **entry)])
    path = moe_sweep.write_tuned(tmp_path, (4, 256, 128), torch.float8_e4m3fn,
                                 [dict(tokens=8, num_pairs=48, config=second, **entry),
                                  dict(tokens=2048, num_pairs=4096, config=second, **entry)])
    assert path.name == "E=4,D=256,I=128,weights=fp8,Test_GPU_1.json"
    monkeypatch.setattr(fused_moe_config, "CONFIG_DIR", tmp_path)
    fused_moe_config.tuned_configs.cache_clear()
    try:
        table = fused_moe_config.tuned_configs(4, 256, 128, "fp8", "Test GPU 1")
    finally:
        fused_moe_config.tuned_configs.cache_clear()
    assert table == {6: first, 48: second, 4096: second}
