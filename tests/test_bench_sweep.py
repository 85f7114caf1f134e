"""`mlaserve bench sweep`: a two-point sweep against the real server (demo model, CPU), the
chart redrawn from hand-made results, and the errors a bad command line gets."""

import json
from pathlib import Path

import pytest

from mlaserve.cli import build_parser
from mlaserve.engine.args import DEMO_MODEL_DIR
from tests.server_util import RunningServer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METRICS = ("output_throughput", "output_throughput_per_gpu", "tok_s_per_user",
           "mean_tok_s_per_user", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "request_throughput", "completed")


def sweep(*argv: str) -> int:
    args = build_parser().parse_args(["bench", "sweep", *argv])
    return args.handler(args)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert 5_000 < len(data) < 2_000_000


def test_a_two_point_sweep_against_the_real_server(tmp_path, capsys):
    result, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    with RunningServer(max_model_len=128) as server:
        status = sweep("--run", f"demo={server.url}", "--max-concurrency-list", "1,2",
                       "--tokenizer", str(DEMO_MODEL_DIR), "--random-input-len", "8",
                       "--random-output-len", "4", "--num-prompts-per-concurrency", "2",
                       "--min-num-prompts", "3", "--num-gpus", "2", "--disable-tqdm",
                       "--result-file", str(result), "--plot-file", str(plot),
                       "--title", "demo on CPU")
    assert status == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    doc = json.loads(result.read_text())
    assert doc["title"] == "demo on CPU" and doc["num_gpus"] == 2
    assert doc["sweep"] == "max_concurrency"
    run = doc["runs"]["demo"]
    assert run["base_url"] == server.url
    points = run["points"]
    assert [p["max_concurrency"] for p in points] == [1, 2]
    assert [p["num_prompts"] for p in points] == [3, 4]  # 2 x concurrency, at least 3
    for p in points:
        assert all(p[key] is not None for key in METRICS), p
        assert p["completed"] == p["num_prompts"] and p["failed"] == 0
        assert p["request_rate"] == "inf"
        assert p["output_throughput"] > 0
        assert p["output_throughput_per_gpu"] == pytest.approx(p["output_throughput"] / 2)
        assert p["tok_s_per_user"] == pytest.approx(1000 / p["median_tpot_ms"])
        assert p["mean_tok_s_per_user"] == pytest.approx(1000 / p["mean_tpot_ms"])
        assert p["total_output_tokens"] == 4 * p["num_prompts"]  # random: EOS ignored
    assert_png(plot)


def point(concurrency: int, per_user: float, per_gpu: float) -> dict:
    return {"max_concurrency": concurrency, "request_rate": "inf", "completed": 8,
            "output_throughput": per_gpu * 8, "output_throughput_per_gpu": per_gpu,
            "tok_s_per_user": per_user, "median_tpot_ms": 1000 / per_user}


def write_result(path: Path, title: str, runs: dict[str, list[dict]]) -> None:
    doc = {"title": title, "num_gpus": 8, "sweep": "max_concurrency",
           "runs": {label: {"base_url": "http://gpu:8000", "sweep": "max_concurrency",
                            "points": points} for label, points in runs.items()}}
    path.write_text(json.dumps(doc))


def test_replot_draws_and_merges_saved_results(tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    write_result(first, "V3 on 8 GPUs", {
        "triton": [point(1, 60.0, 40.0), point(16, 45.0, 400.0), point(64, 30.0, 900.0)],
        "flashinfer": [point(1, 62.0, 41.0), point(16, 47.0, 420.0)]})
    write_result(second, "other", {"triton": [point(1, 58.0, 39.0), point(16, 40.0, 380.0)]})
    assert sweep("--replot", str(first)) == 0
    assert_png(first.with_suffix(".png"))  # the default: beside the JSON
    merged = tmp_path / "out" / "merged.png"
    assert sweep("--replot", str(first), str(second), "--plot-file", str(merged),
                 "--num-gpus", "4") == 0
    assert "3 runs" in capsys.readouterr().out  # triton, flashinfer, b:triton
    assert_png(merged)

    from mlaserve.bench.sweep import merge_results

    runs, title = merge_results([str(first), str(second)], num_gpus=4)
    assert list(runs) == ["triton", "flashinfer", "b:triton"] and title == "V3 on 8 GPUs"
    assert runs["triton"]["points"][1]["output_throughput_per_gpu"] == 400.0 * 8 / 4


def test_bad_command_lines_are_refused_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["bench", "sweep", "--run", "http://127.0.0.1:8000",
                                   "--max-concurrency-list", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--run" in err and "LABEL=BASE_URL" in err
    with pytest.raises(ValueError, match="--max-concurrency-list or --request-rate-list"):
        sweep("--run", "a=http://127.0.0.1:1")
    with pytest.raises(ValueError, match="labels must differ"):
        sweep("--run", "a=http://127.0.0.1:1", "--run", "a=http://127.0.0.1:2",
              "--max-concurrency-list", "1")
    with pytest.raises(ValueError, match="needs --max-concurrency-list"):
        sweep("--run", "a=http://127.0.0.1:1", "--request-rate-list", "1,inf",
              "--num-prompts-per-concurrency", "4")
    not_a_sweep = tmp_path / "serve.json"
    not_a_sweep.write_text(json.dumps({"completed": 3}))
    with pytest.raises(ValueError, match="not a bench sweep result"):
        sweep("--replot", str(not_a_sweep))


def test_a_missing_matplotlib_names_the_extra(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    # refused before any server is asked (nothing listens on port 1)
    assert sweep("--run", "a=http://127.0.0.1:1", "--max-concurrency-list", "1") == 2
    assert "pip install 'mlaserve[plot]'" in capsys.readouterr().err
