"""`mlaserve bench serve` against the real server (demo model, CPU)."""

import argparse
import asyncio

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

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
    """Also `mlaserve bench serve --base-url URL` alone, on the same server afterwards: the
    model name and the tokenizer come from /v1/models (`root` is the model directory as the
    server was given it)."""
    with RunningServer(max_model_len=256) as server:
        result = asyncio.run(bench_serve.run_benchmark(bench_args(server.url)))
        assert "Serving Benchmark Result" in capsys.readouterr().out
        stats = server.wait_idle()
        assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)
        served = server_metrics(server.url)
        parser = argparse.ArgumentParser()
        bench_serve.add_arguments(parser)
        bare = asyncio.run(bench_serve.run_benchmark(parser.parse_args([
            "--base-url", server.url, "--random-input-len", "16", "--random-output-len", "4",
            "--num-prompts", "4", "--max-concurrency", "2", "--disable-tqdm"])))
    assert bare["completed"] == 4 and bare["failed"] == 0
    assert bare["model_id"] == bare["tokenizer_id"] == str(DEMO_MODEL_DIR)
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["output_lens"] == [8] * 12  # ignore_eos: exactly max_tokens each
    assert result["total_output_tokens"] == 96
    # the demo tokenizer adds BOS: the server counts it, as vLLM's usage does
    assert result["total_input_tokens"] == sum(result["input_lens"])
    # 31 random tokens + BOS; re-encoding the decoded soup may drift by a token or two
    assert all(30 <= n <= 35 for n in result["input_lens"])
    ttfts, latencies = np.array(result["ttfts"]), np.array(result["latencies"])
    tpots = (latencies - ttfts) / (np.array(result["output_lens"]) - 1)
    # A stream that lags behind the engine gets its token deltas merged into one chunk (as
    # vLLM's server does), so a request sees at most one gap per token after the first.
    assert all(1 <= len(gaps) <= 7 for gaps in result["itls"])
    for gaps, ttft, latency in zip(result["itls"], ttfts, latencies, strict=True):
        assert sum(gaps) == pytest.approx(latency - ttft, abs=0.05)
    # What the client measured against what the server recorded (/metrics): the same requests
    # and tokens; the client's times include HTTP and detokenizing, so they are a little longer.
    assert served["vllm:request_success_total"] == 12
    assert served["vllm:prompt_tokens_total"] == result["total_input_tokens"]
    assert served["vllm:generation_tokens_total"] == 96
    assert served["vllm:time_to_first_token_seconds_count"] == 12
    for name, client_times in (("vllm:time_to_first_token_seconds", ttfts),
                               ("vllm:e2e_request_latency_seconds", latencies)):
        server_total = served[f"{name}_sum"]
        assert server_total <= client_times.sum() <= server_total + 12 * 0.25, name
    assert result["median_tpot_ms"] == pytest.approx(np.median(tpots) * 1000)
    assert result["duration"] >= latencies.max()
    assert result["output_throughput"] == pytest.approx(96 / result["duration"])


def server_metrics(url: str) -> dict[str, float]:
    """The server's /metrics as {sample name: value}, summed over label sets."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_bench_serve_reports_a_speculating_servers_acceptance(capsys):
    """A server that speculates (the demo config with an MTP layer, dummy weights) publishes
    vLLM's spec-decode counters, and `bench serve` prints and saves its run's acceptance from
    them (the counters' growth over the run)."""
    with RunningServer(load_format="dummy", max_model_len=256,
                       hf_overrides={"num_nextn_predict_layers": 1, "num_hidden_layers": 2},
                       speculative_config={"method": "mtp", "num_speculative_tokens": 2}
                       ) as server:
        result = asyncio.run(bench_serve.run_benchmark(bench_args(server.url)))
        served = server_metrics(server.url)
    out = capsys.readouterr().out
    assert "Speculative Decoding" in out and "Acceptance length:" in out
    drafts = served["vllm:spec_decode_num_drafts_total"]
    assert result["spec_decode_num_drafts"] == drafts > 0  # the run's drafts: all of them
    assert result["spec_decode_draft_tokens"] == served["vllm:spec_decode_num_draft_tokens_total"]
    assert result["spec_decode_draft_tokens"] >= drafts
    assert result["spec_decode_acceptance_length"] == pytest.approx(
        1 + served["vllm:spec_decode_num_accepted_tokens_total"] / drafts)
    assert result["output_lens"] == [8] * 12  # speculation changes no count
