"""The kernel sweep's machinery on the CPU: grid, roofline, inputs, gate, outputs (tiny shapes).

The sweep runs through `mlaserve bench kernel` (cli.main) with the torch backend; deliberately
wrong backends registered for one test must be reported as failed and never timed. The triton
backend joins when Triton's CPU interpreter works here (float32 and float16 only: its bfloat16 dot
is not faithful).
"""

import json
import math
import os
import sys

import pytest
import torch

from mlaserve.attention import registry
from mlaserve.attention.torch_backend import TorchMLABackend, torch_mla_decode
from mlaserve.bench import kernel as bench_kernel
from mlaserve.bench.kernel_cases import copies_needed, make_inputs
from mlaserve.bench.kernel_grid import (
    Cell,
    anchor_cells,
    coverage_cells,
    decode_bytes,
    decode_flops,
    flag_cells,
    floor_seconds,
)
from mlaserve.bench.kernel_sweep import parse_sweep, split_variant, variant_name
from mlaserve.cli import main

ON_GPU = torch.cuda.is_available()  # without it conftest.py sets TRITON_INTERPRET=1

# Tiny sweep: L = 32, R = 16; kv 20 is not a multiple of block 8, so each last page has a tail.
TINY = ["--kv-lora-rank", "32", "--rope-dim", "16", "--heads", "2", "--batch-sizes", "1,3",
        "--kv-lens", "20", "--block-sizes", "8", "--repeats", "2", "--device", "cpu"]


class ZerosBackend(TorchMLABackend):
    """Returns zeros: plausible shapes, wrong numbers."""

    name = "zeros"

    def run(self, q, kv_cache, return_lse=False):
        o = torch.zeros(q.shape[0], q.shape[1], self.shape.kv_lora_rank, dtype=q.dtype)
        lse = torch.zeros(q.shape[0], q.shape[1])
        return (o, lse) if return_lse else o


class WholePagesBackend(TorchMLABackend):
    """Attends every row of the last page, tail included (reads the NaN poison)."""

    name = "whole-pages"

    def run(self, q, kv_cache, return_lse=False):
        full = torch.full_like(self.seq_lens, self.block_table.shape[1] * kv_cache.shape[1])
        o, lse = torch_mla_decode(q, kv_cache, self.block_table, full, self.softmax_scale,
                                  self.shape.kv_lora_rank, self.q_len, self.max_rows_per_chunk)
        return (o.to(q.dtype), lse) if return_lse else o.to(q.dtype)


class Base2LseBackend(TorchMLABackend):
    """Right output, but the LSE in base 2 (FlashInfer's convention, unconverted)."""

    name = "base2-lse"

    def run(self, q, kv_cache, return_lse=False):
        o, lse = super().run(q, kv_cache, return_lse=True)
        return (o, lse / math.log(2)) if return_lse else o


def _sweep(tmp_path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "out"
    argv = ["bench", "kernel", *TINY, "--out", str(out), *flags]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["mlaserve", *argv])  # what the JSON records as the command
        rc = main(argv)
    return rc, json.loads((out / "kernel_bench.json").read_text())


def _results(record: dict) -> dict[tuple, dict]:
    """(heads, batch, kv, block, q_len, backend) -> result."""
    return {(c["num_heads"], c["batch_size"], c["kv_len"], c["block_size"], c["q_len"],
             r["backend"]): r for c in record["cells"] for r in c["results"]}


def test_anchor_preset_is_exactly_the_anchor_cells():
    expected = {Cell(h, b, kv, 64) for h in (16, 128) for b in (1, 64, 512) for kv in (1024, 4096)}
    expected |= {Cell(16, 1, 8192, 64), Cell(128, 1, 8192, 64), Cell(16, 512, 4096, 32),
                 Cell(16, 64, 4096, 64, 2), Cell(16, 64, 4096, 64, 4)}
    cells = anchor_cells()
    assert len(cells) == len(set(cells)) == 17
    assert set(cells) == expected
    parser_args = bench_kernel_args("--grid", "anchor")
    assert bench_kernel.grid_cells(parser_args) == cells


def test_coverage_preset_adds_page_sizes_and_ragged_batches_to_the_anchor_grid():
    cells = coverage_cells()
    assert set(anchor_cells()) < set(cells) and len(cells) == len(set(cells)) == 17 + 8 + 10
    assert {c.block_size for c in cells if c.num_heads == 16} == {16, 32, 64, 128}
    ragged = [c for c in cells if c.ragged]
    assert {(c.num_heads, c.batch_size) for c in ragged} == {
        (heads, batch) for heads in (16, 128) for batch in (16, 64, 128, 256, 512)}
    assert all(c.kv_len == 8192 and min(c.seq_lens()) >= 1 for c in ragged)
    assert bench_kernel.grid_cells(bench_kernel_args("--grid", "coverage")) == cells
    with pytest.raises(ValueError, match="--grid coverage fixes the cells; drop --heads"):
        bench_kernel.grid_cells(bench_kernel_args("--grid", "coverage", "--heads", "16"))


def bench_kernel_args(*flags: str):
    import argparse

    parser = argparse.ArgumentParser()
    bench_kernel.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_grid_flags_and_their_conflict_with_the_preset():
    args = bench_kernel_args("--heads", "16", "--batch-sizes", "1,2", "--kv-lens", "64",
                             "--block-sizes", "16,32", "--q-lens", "1,3")
    cells = bench_kernel.grid_cells(args)
    assert len(cells) == 8 and set(cells) == set(flag_cells([16], [1, 2], [64], [16, 32], [1, 3]))
    assert len(bench_kernel.grid_cells(bench_kernel_args())) == 12  # defaults: 2 x 3 x 2
    with pytest.raises(ValueError, match="--grid anchor fixes the cells; drop --heads"):
        bench_kernel.grid_cells(bench_kernel_args("--grid", "anchor", "--heads", "16"))
    assert bench_kernel_args().mode == "graph"
    assert bench_kernel_args("--eager").mode == "eager"


def test_ragged_cells_beside_uniform_ones(tmp_path):
    ragged = Cell(2, 5, 20, 8, 2, ragged=True)
    lengths = ragged.seq_lens()
    assert lengths == ragged.seq_lens() and len(set(lengths)) > 1
    assert all(2 <= n <= 20 for n in lengths)
    assert decode_bytes(ragged, 32, 16, 4) == (sum(lengths) * 48 + 5 * 2 * 2 * 80) * 4
    assert decode_flops(ragged, 32, 16) == 2 * 2 * 2 * sum(lengths) * 80
    inputs = make_inputs(ragged, 32, 16, torch.float32, torch.device("cpu"), 0.1, 1, seed=3)
    assert inputs.seq_lens.tolist() == lengths
    assert inputs.block_table.shape == (5, -(-max(lengths) // 8))
    rc, record = _sweep(tmp_path, "--backends", "torch", "--ragged", "--batch-sizes", "3")
    assert rc == 0
    assert [c["ragged"] for c in record["cells"]] == [False, True]
    assert all(r["status"] == "ok" for c in record["cells"] for r in c["results"])


def test_sweep_specs(capsys):
    assert parse_sweep("block_n=32,64 num_stages=2;num_splits=4") == [
        {"block_n": 32, "num_stages": 2, "num_splits": 4},
        {"block_n": 64, "num_stages": 2, "num_splits": 4}]
    assert parse_sweep("tma_loads=1 partial_dtype=input") == [
        {"tma_loads": True, "partial_dtype": "input"}]
    name = variant_name({"block_n": 32, "programs_per_sm": 2.0})
    assert name == "triton[block_n=32,programs_per_sm=2.0]"
    assert split_variant(name) == ("triton", {"block_n": 32, "programs_per_sm": 2.0})
    assert split_variant("flashinfer") == ("flashinfer", {})
    for bad in ("bogus=1", "block_n=", "block_n=x", "tma_loads=maybe", ""):
        with pytest.raises(ValueError):
            parse_sweep(bad)
    assert main(["bench", "kernel", *TINY, "--backends", "torch", "--sweep", "block_n=16"]) != 0
    assert "add it to --backends" in capsys.readouterr().err


def test_backend_names():
    assert bench_kernel.backend_names(None) == ["torch", "triton", "flashinfer"]
    assert bench_kernel.backend_names("TRITON_MLA, torch,flashinfer-fa2") == [
        "triton", "torch", "flashinfer-fa2"]
    with pytest.raises(ValueError, match="unknown attention backend"):
        bench_kernel.backend_names("nope")
    with pytest.raises(ValueError, match="not 'auto'"):
        bench_kernel.backend_names("auto")


def test_roofline_on_the_anchor_numbers():
    # ceilings once measured on an H200: copy 4273 GB/s, matmul 671 TFLOP/s.
    copy_rate, matmul_rate = 4273e9, 671e12
    memory_bound = Cell(16, 64, 4096, 64)
    assert decode_bytes(memory_bound, 512, 64) == 64 * 4096 * 576 * 2 + 64 * 16 * 1088 * 2
    assert decode_bytes(memory_bound, 512, 64) == 304_218_112
    assert decode_flops(memory_bound, 512, 64) == 2 * 64 * 16 * 4096 * 1088 == 9_126_805_504
    floor = floor_seconds(304_218_112, 9_126_805_504, copy_rate, matmul_rate)
    assert floor == pytest.approx(304_218_112 / copy_rate)
    assert floor * 1e6 == pytest.approx(71.2, abs=0.05)
    compute_bound = Cell(128, 512, 4096, 64)
    num_bytes = decode_bytes(compute_bound, 512, 64)
    flops = decode_flops(compute_bound, 512, 64)
    assert (num_bytes, flops) == (2_558_525_440, 584_115_552_256)
    floor = floor_seconds(num_bytes, flops, copy_rate, matmul_rate)
    assert floor == pytest.approx(flops / matmul_rate)
    assert floor * 1e6 == pytest.approx(870.5, abs=0.1)  # the anchor table's 870.7 rounds both
    # q_len multiplies the query rows; float32 doubles the bytes.
    spec = Cell(16, 64, 4096, 64, 2)
    assert decode_bytes(spec, 512, 64) == 64 * 4096 * 576 * 2 + 64 * 2 * 16 * 1088 * 2
    assert decode_flops(spec, 512, 64) == 2 * decode_flops(memory_bound, 512, 64)
    assert decode_bytes(spec, 512, 64, element_size=4) == 2 * decode_bytes(spec, 512, 64)


def test_copies_exceed_twice_the_l2(monkeypatch):
    cell = Cell(16, 1, 1024, 64)
    assert copies_needed(cell, 512, 64, 2, torch.device("cpu")) == 1
    monkeypatch.setattr("mlaserve.bench.kernel_cases.l2_bytes", lambda device: 60 * 2**20)
    copies = copies_needed(cell, 512, 64, 2, torch.device("cuda"))
    touched = decode_bytes(cell, 512, 64)
    assert copies * touched > 2 * 60 * 2**20 >= (copies - 1) * touched
    assert copies_needed(Cell(16, 512, 4096, 64), 512, 64, 2, torch.device("cuda")) == 1


def test_inputs_are_shuffled_and_poisoned():
    cell = Cell(2, 3, 20, 8)
    inputs = make_inputs(cell, 32, 16, torch.float32, torch.device("cpu"), 0.1, 2, seed=1)
    table = inputs.block_table
    assert table.shape == (3, 3) and table.dtype == torch.int32
    assert table.unique().numel() == 9
    assert not torch.equal(table.flatten().sort().values, table.flatten())  # shuffled
    cache = inputs.caches[0]
    used = torch.zeros(cache.shape[0], dtype=torch.bool)
    used[table.flatten().long()] = True
    assert bool(cache[~used].isnan().all()) and int((~used).sum()) >= 2
    last_pages = cache[table[:, -1].long()]  # [3, 8, 48]: 20 = 2 * 8 + 4, a tail of 4 rows
    assert bool(last_pages[:, 4:].isnan().all()) and bool(last_pages[:, :4].isfinite().all())
    assert bool(cache[table[:, :-1].flatten().long()].isfinite().all())
    assert len(inputs.caches) == len(inputs.queries) == 2
    assert torch.equal(inputs.queries[0], inputs.queries[1])
    assert inputs.caches[0].data_ptr() != inputs.caches[1].data_ptr()
    assert inputs.ref_o.shape == (3, 2, 32) and bool(inputs.ref_o.isfinite().all())


def test_sweep_writes_json_and_png(tmp_path):
    rc, record = _sweep(tmp_path, "--backends", "torch", "--q-lens", "1,2", "--dtype", "fp32")
    assert rc == 0
    assert (tmp_path / "out" / "kernel_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["complete"] is True
    assert record["device"]["type"] == "cpu" and record["timing"] == "cpu"
    assert record["versions"]["torch"] == torch.__version__
    assert record["command"].startswith("mlaserve bench kernel --kv-lora-rank 32")
    assert record["date"] and record["args"]["q_lens"] == [1, 2]
    assert record["ceilings"] is None and any("no CUDA" in note for note in record["notes"])
    assert len(record["cells"]) == 4  # batch {1, 3} x q_len {1, 2}
    for cell in record["cells"]:
        assert cell["bytes"] == decode_bytes(
            Cell(cell["num_heads"], cell["batch_size"], cell["kv_len"], cell["block_size"],
                 cell["q_len"]), 32, 16, element_size=4)
        (result,) = cell["results"]
        assert result["status"] == "ok" and result["time_us"] > 0 and result["gbps"] > 0
        assert result["gate"]["rel_err"] < 1e-5 and result["pct_floor"] is None


def test_gate_excludes_wrong_backends_from_timing(tmp_path, monkeypatch, capsys):
    for cls in (ZerosBackend, WholePagesBackend, Base2LseBackend):
        monkeypatch.setitem(registry._BACKENDS, cls.name, f"{__name__}:{cls.__name__}")
    rc, record = _sweep(tmp_path, "--backends", "torch,zeros,whole-pages,base2-lse",
                        "--dtype", "fp32")
    assert rc == 1
    captured = capsys.readouterr()
    assert "gate or run failures" in captured.err and "zeros on" in captured.err
    results = _results(record)
    for batch in (1, 3):
        key = (2, batch, 20, 8, 1)
        assert results[(*key, "torch")]["status"] == "ok"
        for name, why in (("zeros", "rel_err"), ("whole-pages", "non-finite"),
                          ("base2-lse", "natural log")):
            result = results[(*key, name)]
            assert result["status"] == "failed" and why in result["reason"]
            assert result["time_us"] is None and result["gbps"] is None
    assert "failed: gate:" in captured.out  # and the table says so
    # the table prints each gated backend's cosine gap to the float32 reference
    header, _, *rows = captured.out[captured.out.index("heads batch"):].splitlines()
    assert "1-cos" in header
    torch_gap = results[(2, 1, 20, 8, 1, "torch")]["gate"]["cos_gap"]
    assert any(" torch " in row and f"{torch_gap:8.1e}" in row for row in rows)


def test_sweep_reports_unsupported_backends_as_skipped(tmp_path):
    rc, record = _sweep(tmp_path, "--backends", "torch,flashinfer", "--dtype", "fp32")
    assert rc == 0
    for (*_, name), result in _results(record).items():
        if name == "flashinfer":
            assert result["status"] == "skipped" and "runs on cuda" in result["reason"]


def _triton_interpreter_works() -> bool:
    if ON_GPU:
        return False
    try:
        import triton  # noqa: F401

        from mlaserve.attention.triton_backend import TritonMLABackend  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _triton_interpreter_works(),
                    reason="needs Triton, the triton backend and TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_sweep_with_the_triton_interpreter(tmp_path, capsys, dtype):
    # float32 also sweeps two forced split counts: variants of the plan, gated and timed beside it
    sweep = ["--sweep", "num_splits=1,3"] if dtype == "fp32" else []
    rc, record = _sweep(tmp_path, "--dtype", dtype, "--q-lens", "1,2", "--repeats", "1", *sweep)
    assert rc == 0
    names = {r["backend"] for c in record["cells"] for r in c["results"]}
    variants = {"triton[num_splits=1]", "triton[num_splits=3]"} if sweep else set()
    assert names == {"torch", "triton"} | variants  # flashinfer left out by default on the CPU
    assert any("flashinfer left out" in note for note in record["notes"])
    for result in _results(record).values():
        assert result["status"] == "ok", result
    printed = capsys.readouterr().out
    for key, result in _results(record).items():
        if key[-1].startswith("triton"):  # the kernel and configuration the plan chose
            assert result["plan"].startswith("triton_split m16 n")
            assert f"    {key[-1]} runs {result['plan']}" in printed
        else:
            assert result["plan"] == "torch"
    if sweep:
        plan = _results(record)[(2, 3, 20, 8, 1, "triton[num_splits=3]")]["plan"]
        assert " splits 3 (waves" in plan and "splits 1" in _results(record)[
            (2, 3, 20, 8, 1, "triton[num_splits=1]")]["plan"]


def test_replay_times_the_recorded_steps_and_weighs_them_by_time(tmp_path, capsys):
    """--replay builds one cell per picked step with that step's own lengths (evenly spaced
    over the record, first and last included), gates and times each backend on them, and
    prints each backend's time-weighted speed against the best peer."""
    from mlaserve.bench.kernel_grid import replay_cells
    from mlaserve.bench.kernel_report import BackendResult, CellResult
    from mlaserve.engine.decode_record import DecodeStep, DecodeStepRecorder

    steps = [DecodeStep(1, [3 + i, 9, 1 + 2 * i]) for i in range(7)]
    cells = replay_cells(steps, num_heads=2, block_size=8, max_steps=3)
    assert [c.step for c in cells] == [0, 3, 6]
    assert cells[1].seq_lens() == [6, 9, 7] and cells[1].kv_len == 9
    assert cells[1].batch_size == 3 and "step3" in cells[1].label
    assert cells[1].plan_len is None
    with pytest.raises(ValueError, match="empty"):
        replay_cells([], 2, 8, 3)

    record = tmp_path / "steps.jsonl"
    recorder = DecodeStepRecorder(record)
    for step in steps:
        recorder.record(step.seq_lens, step.q_len, len(step.seq_lens), 16)
    recorder.close()
    rc, written = _sweep(tmp_path, "--backends", "torch", "--replay", str(record),
                         "--replay-steps", "2")
    assert rc == 0
    assert [c["lengths"] for c in written["cells"]] == [[3, 9, 1], [9, 9, 13]]
    assert all(r["status"] == "ok" for c in written["cells"] for r in c["results"])
    assert "replay of" in capsys.readouterr().out

    # a step its server ran in a decode graph of 8 rows covering 64 tokens replays so: rows
    # of no keys up to 8, and the graphs' table as wide as 64 tokens
    served = [DecodeStep(1, [5, 30, 2], 8, 64), DecodeStep(1, [40] * 10)]
    padded, old = replay_cells(served, num_heads=2, block_size=8, max_steps=2)
    assert padded.seq_lens() == [5, 30, 2, 0, 0, 0, 0, 0] and padded.plan_len == 64
    assert old.batch_size == 10 and old.plan_len is None
    # an older record's step, planned as graphs of 48 tokens would: capture size 16 for 10
    old = replay_cells(served, 2, 8, 2, graph_len=48)[1]
    assert old.seq_lens() == [40] * 10 + [0] * 6 and old.plan_len == 48
    assert replay_cells(served, 2, 8, 2, graph_len=32)[1].plan_len is None  # 40 > 32: eager

    def cell(peer_s: float, own_s: float) -> CellResult:
        result = CellResult(cells[0], 0, 0, None, 1)
        result.results = [BackendResult("flashinfer", "ok", seconds=peer_s),
                          BackendResult("triton", "ok", seconds=own_s)]
        return result

    summary = bench_kernel.replay_summary([cell(1.0, 2.0), cell(3.0, 2.0)], "p")
    assert "  triton: 1.000" in summary  # (1 + 3) / (2 + 2), not the mean of 0.5 and 1.5
