"""The arithmetic of `mlaserve bench model-step` (the timed pieces need a GPU)."""

import argparse
import json
from pathlib import Path

import pytest

from mlaserve.bench.model_step import Pieces, _cases, collective_seconds, step_seconds

V3 = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
                 / "deepseek-v3.json").read_text())


def test_collective_time_is_latency_plus_bytes_over_bus_bandwidth():
    # 1 GB all-reduced over 8 ranks at 350 GB/s bus bandwidth: 2 * 7 / 8 * 1 / 350 s
    assert collective_seconds(1e9, 1.75, 350, 10e-6) == pytest.approx(10e-6 + 1.75 / 350)


def test_step_composes_layers_and_collectives():
    pieces = Pieces(dense_layer=100e-6, moe_layer=400e-6, logits=300e-6)
    tp = step_seconds("tp8", pieces, 64, V3, bus_bandwidth=350, latency=10e-6)
    assert tp["compute"] == pytest.approx(3 * 100e-6 + 58 * 400e-6 + 300e-6)
    all_reduce = 10e-6 + 64 * 7168 * 2 * 1.75 / 350e9
    gather = 10e-6 + 64 * 129280 * 2 * 0.875 / 350e9
    assert tp["comm"] == pytest.approx(2 * 61 * all_reduce + gather)
    ep = step_seconds("dp8-ep8", pieces, 1024, V3, bus_bandwidth=350, latency=10e-6)
    dispatch = 10e-6 + 1024 * (7168 + 32) * 2 * 0.875 / 350e9
    combine = 10e-6 + 1024 * 7168 * 2 * 0.875 / 350e9
    assert ep["comm"] == pytest.approx(58 * (dispatch + combine))
    assert ep["step"] == pytest.approx(ep["compute"] + ep["comm"])


def test_cases_name_what_to_change():
    assert _cases("64:1500,1024:2000") == [(64, 1500), (1024, 2000)]
    with pytest.raises(argparse.ArgumentTypeError, match="divisible by 8"):
        _cases("60:1500")
    with pytest.raises(argparse.ArgumentTypeError, match="CONCURRENCY:CONTEXT"):
        _cases("64")
