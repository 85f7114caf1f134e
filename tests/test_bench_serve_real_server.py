"""`mlaserve bench serve` against the real server (demo model, CPU)."""

import argparse
import asyncio

import numpy as np
import pytest

from mlaserve.bench import serve as bench_serve
from mlaserve.engine.args import DEMO_MODEL_DIR
from tests.server_util import RunningServer


def bench_args(url: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args([
        "--base-url", url, "--model", "demo", "--tokenizer", str(DEMO_MODEL_DIR),
        "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
        "--num-prompts", "12", "--max-concurrency", "4", "--ignore-eos", "--save-detailed",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm", *extra])


def test_bench_serve_against_the_real_server(capsys):
    with RunningServer(max_model_len=256) as server:
        result = asyncio.run(bench_serve.run_benchmark(bench_args(server.url)))
        assert "Serving Benchmark Result" in capsys.readouterr().out
        stats = server.wait_idle()
        assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["output_lens"] == [8] * 12  # ignore_eos: exactly max_tokens each
    assert result["total_output_tokens"] == 96
    # the demo tokenizer adds BOS: the server counts it, as vLLM's usage does
    assert result["total_input_tokens"] == sum(result["input_lens"])
    # 31 random tokens + BOS; re-encoding the decoded soup may drift by a token or two
    assert all(30 <= n <= 35 for n in result["input_lens"])
    ttfts, latencies = np.array(result["ttfts"]), np.array(result["latencies"])
    tpots = (latencies - ttfts) / (np.array(result["output_lens"]) - 1)
    itls = [gap for gaps in result["itls"] for gap in gaps]
    # A stream that lags behind the engine gets its token deltas merged into one chunk (as
    # vLLM's server does), so a request sees at most one gap per token after the first.
    assert all(1 <= len(gaps) <= 7 for gaps in result["itls"])
    for gaps, ttft, latency in zip(result["itls"], ttfts, latencies, strict=True):
        assert sum(gaps) == pytest.approx(latency - ttft, abs=0.05)
    assert result["mean_ttft_ms"] == np.mean(ttfts) * 1000
    assert result["median_tpot_ms"] == np.median(tpots) * 1000
    assert result["p99_itl_ms"] == np.percentile(itls, 99) * 1000
    assert result["mean_e2el_ms"] == np.mean(latencies) * 1000
    assert result["output_throughput"] == 96 / result["duration"]
