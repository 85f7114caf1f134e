"""`mlaserve bench serve` against a scripted server on a virtual clock (tests/bench_serve_util.py):
exact timing metrics, the rate and concurrency schedule, failures, and the summary recomputed
from the detailed records."""

import json

import numpy as np
import pytest

from tests.bench_serve_util import (
    TICK,
    FakeServer,
    Plan,
    approx,
    assert_section,
    bench_args,
    run_against,
    varied_plan,
)

# the fixtures (run_virtual, tokenizer, tokenizer_dir) come from tests/bench_serve_util.py,
# a plugin of tests/conftest.py
pytestmark = pytest.mark.usefixtures("no_proxy")

# ---------------------------------------------------------------------------------------------
# (a) exact timing metrics


def test_timing_metrics_match_the_script(run_virtual, tokenizer, tokenizer_dir, tmp_path):
    num = 5
    server = FakeServer(tokenizer, varied_plan)
    result = run_against(run_virtual, server, lambda url: bench_args(
        url, tokenizer_dir, "--num-prompts", str(num),
        "--random-range-ratio", '{"input": 0.0, "output": 0.5}',
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99.9",
        "--save-detailed", "--temperature", "0", "--top-k", "5",
    ), tokenizer)

    output_lens = [server.bodies[i]["max_tokens"] for i in range(num)]
    assert len(set(output_lens)) > 1 and all(3 <= n <= 9 for n in output_lens)
    plans = [varied_plan(i, output_lens[i]) for i in range(num)]
    ttfts = [p.ttft_ticks * TICK for p in plans]
    itls = [[g * TICK for g in p.gap_ticks] for p in plans]
    e2els = [t + sum(gaps) for t, gaps in zip(ttfts, itls, strict=True)]
    tpots = [(e - t) / (n - 1) for e, t, n in zip(e2els, ttfts, output_lens, strict=True)]

    assert result["completed"] == num and result["failed"] == 0
    assert result["ttfts"] == approx(ttfts)
    assert result["itls"] == [approx(gaps) for gaps in itls]
    assert result["latencies"] == approx(e2els)
    assert result["output_lens"] == output_lens
    assert result["start_times"] == [result["start_times"][0]] * num  # rate inf: all at once
    assert result["duration"] == approx(max(e2els))
    percentiles = [50.0, 90.0, 99.9]
    assert_section(result, "ttft", ttfts, percentiles)
    assert_section(result, "tpot", tpots, percentiles)
    assert_section(result, "itl", [g for gaps in itls for g in gaps], percentiles)
    assert_section(result, "e2el", e2els, percentiles)
    prompt_tokens = [server.prompt_tokens(server.bodies[i]) for i in range(num)]
    assert result["input_lens"] == prompt_tokens  # usage.prompt_tokens, BOS included
    assert result["total_input_tokens"] == sum(prompt_tokens)
    assert result["total_output_tokens"] == sum(output_lens)
    assert result["request_throughput"] == approx(num / max(e2els))
    assert result["output_throughput"] == approx(sum(output_lens) / max(e2els))
    assert result["max_output_tokens_per_s"] == sum(output_lens)  # one chunk per token, < 1 s
    assert result["max_concurrent_requests"] == num
    assert result["request_goodput"] is None

    body = server.bodies[0]
    assert list(body) == ["model", "prompt", "repetition_penalty", "max_tokens", "logprobs",
                          "stream", "stream_options", "ignore_eos", "top_k", "temperature"]
    assert body["model"] == "tiny-model" and body["logprobs"] is None
    assert body["repetition_penalty"] == 1.0 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_k"]) == (0.0, 5)
    assert server.headers[3]["x-request-id"] == "bench-test-3"


def test_rate_and_concurrency_schedule(run_virtual, tokenizer, tokenizer_dir, capsys):
    """rate 16/s with constant intervals, at most 2 in flight: exact send and queue times."""
    num = 6
    server = FakeServer(tokenizer, lambda i, n: Plan(ttft_ticks=8, gap_ticks=[8] * (n - 1)))
    result = run_against(run_virtual, server, lambda url: bench_args(
        url, tokenizer_dir, "--num-prompts", str(num), "--random-output-len", "3",
        "--request-rate", "16", "--burstiness", "inf", "--max-concurrency", "2",
        "--percentile-metrics", "ttft,e2el,client_queue_time,e2el_including_client_queue",
        "--save-detailed", "--goodput", "ttft:70", "e2el:1000",
    ), tokenizer)

    latency = 24 * TICK  # 3 chunks, 8 ticks apart
    arrivals = [(i + 1) / 16 for i in range(num)]  # rescaled: the last one lands at num / rate
    starts, free = [], [0.0, 0.0]
    for arrival in arrivals:  # two slots, each busy for `latency`
        slot = int(np.argmin(free))
        starts.append(max(arrival, free[slot]))
        free[slot] = starts[-1] + latency
    t0 = result["start_times"][0] - starts[0]
    assert [s - t0 for s in result["start_times"]] == approx(starts)
    queues = [s - a for s, a in zip(starts, arrivals, strict=True)]
    assert result["queue_times"] == approx(queues)
    assert_section(result, "client_queue_time", queues, [99.0])
    assert_section(result, "e2el_including_client_queue", [latency + q for q in queues], [99.0])
    assert result["duration"] == approx(max(starts) + latency)
    assert result["max_concurrency"] == 2 and result["request_rate"] == 16.0
    assert result["request_goodput"] == approx(num / result["duration"])  # TTFT 62.5 ms < 70
    printed = capsys.readouterr().out
    assert "Traffic request rate: 16.0\nBurstiness factor: inf (Gamma distribution)\n" in printed
    assert "Maximum request concurrency:             2         \n" in printed
    assert "Request rate configured (RPS):           16.00     \n" in printed
    assert "Request goodput (req/s):" in printed
    assert "-------------Client-side Queueing-------------" in printed


def test_chat_backend_skips_role_chunk(run_virtual, tokenizer, tokenizer_dir):
    server = FakeServer(tokenizer, lambda i, n: Plan(ttft_ticks=4, gap_ticks=[2] * (n - 1)))
    result = run_against(run_virtual, server, lambda url: bench_args(
        url, tokenizer_dir, "--num-prompts", "2", "--backend", "openai-chat",
        "--endpoint", "/v1/chat/completions", "--save-detailed",
    ), tokenizer)
    assert result["ttfts"] == approx([4 * TICK] * 2)
    assert result["itls"] == [approx([2 * TICK] * 5)] * 2
    assert result["generated_texts"][0] == " w0 w1 w2 w3 w4 w5"
    body = server.bodies[0]
    assert list(body) == ["model", "messages", "max_completion_tokens", "stream",
                          "stream_options", "ignore_eos"]
    assert body["messages"][0]["role"] == "user"
    assert body["messages"][0]["content"][0]["type"] == "text"
    assert server.headers[0]["Content-Type"] == "application/json"


def test_ready_check_and_warmups(run_virtual, tokenizer, tokenizer_dir, capsys):
    """The ready check retries every 5 s until the test request succeeds; warmups are copies of
    request 0; neither is part of the measured run."""
    untagged_failures = iter([True, True])

    def plan(index: int, max_tokens: int) -> Plan:
        if index == -1 and next(untagged_failures, False):
            return Plan(status=503)
        return Plan(ttft_ticks=2, gap_ticks=[1] * (max_tokens - 1))

    server = FakeServer(tokenizer, plan)
    result = run_against(run_virtual, server, lambda url: bench_args(
        url, tokenizer_dir, "--num-prompts", "3", "--ready-check-timeout-sec", "30",
        "--num-warmups", "2",
    ), tokenizer)
    assert server.untagged == 3 + 2  # two failed probes, one good probe, two warmups
    assert result["completed"] == 3 and result["duration"] == approx(7 * TICK)
    out = capsys.readouterr().out
    assert out.count("WARNING: Endpoint is not ready. Error='Service Unavailable'") == 2
    assert "Initial test run completed.\nWarming up with 2 requests...\nWarmup run completed." \
        in out


# ---------------------------------------------------------------------------------------------
# (b) failures and (c) metrics recomputed from the detailed records


def failing_plan(index: int, max_tokens: int) -> Plan:
    if index in (1, 4):
        return Plan(status=500)
    if index == 2:
        return Plan(ttft_ticks=3, gap_ticks=[2] * (max_tokens - 1), break_after=3)
    if index == 5:  # no usage chunk: output length comes from the tokenizer
        return Plan(ttft_ticks=5, gap_ticks=[1] * (max_tokens - 1), usage=False)
    return varied_plan(index, max_tokens)


def test_failed_requests_are_counted(run_virtual, tokenizer, tokenizer_dir, tmp_path, capsys):
    result = run_against(run_virtual, FakeServer(tokenizer, failing_plan), lambda url: bench_args(
        url, tokenizer_dir, "--num-prompts", "7", "--save-result", "--save-detailed",
        "--result-dir", str(tmp_path), "--result-filename", "run.json",
    ), tokenizer)
    assert result["completed"] == 4 and result["failed"] == 3
    errors = result["errors"]
    assert errors[1] == errors[4] == "Internal Server Error"
    assert "ClientPayloadError" in errors[2]
    assert [i for i, e in enumerate(errors) if e] == [1, 2, 4]
    assert result["output_lens"][1] == result["output_lens"][2] == 0
    assert result["output_lens"][5] == len(
        tokenizer(result["generated_texts"][5], add_special_tokens=False).input_ids)
    printed = capsys.readouterr().out
    assert "Failed requests during benchmark run detected (capping to 10):" in printed
    assert "Failed requests:                         3         \n" in printed
    assert json.loads((tmp_path / "run.json").read_text()) == result


def test_summary_recomputed_from_detailed_records(run_virtual, tokenizer, tokenizer_dir,
                                                  tmp_path):
    run_against(run_virtual, FakeServer(tokenizer, failing_plan), lambda url: bench_args(
        url, tokenizer_dir, "--num-prompts", "7", "--save-result", "--save-detailed",
        "--result-dir", str(tmp_path), "--result-filename", "run.json",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "25,50,99",
        "--goodput", "tpot:20",
    ), tokenizer)
    r = json.loads((tmp_path / "run.json").read_text())
    ok = [i for i, n in enumerate(r["output_lens"]) if n > 0]
    assert r["completed"] == len(ok) and r["failed"] == len(r["output_lens"]) - len(ok)
    ttfts = [r["ttfts"][i] for i in ok]
    e2els = [r["latencies"][i] for i in ok]
    tpots = [(r["latencies"][i] - r["ttfts"][i]) / (r["output_lens"][i] - 1)
             for i in ok if r["output_lens"][i] > 1]
    itls = [gap for i in ok for gap in r["itls"][i]]
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        assert_section(r, key, values, [25.0, 50.0, 99.0])
    total_in = sum(r["input_lens"][i] for i in ok)
    total_out = sum(r["output_lens"])
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (total_in, total_out)
    assert r["request_throughput"] == approx(len(ok) / r["duration"])
    assert r["output_throughput"] == approx(total_out / r["duration"])
    assert r["total_token_throughput"] == approx((total_in + total_out) / r["duration"])
    assert r["request_goodput"] == approx(sum(t <= 0.020 for t in tpots) / r["duration"])
    t0 = min(r["start_times"][i] for i in ok)
    events = [r["start_times"][i] + r["ttfts"][i] + sum(r["itls"][i][:k])
              for i in ok for k in range(len(r["itls"][i]) + 1)]
    assert r["max_output_tokens_per_s"] == max(np.bincount([int(t - t0) for t in events]))
    assert r["max_concurrent_requests"] == len(ok)  # all inside the first second
    keys = list(r)
    assert keys[:14] == ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
                         "num_prompts", "request_rate", "burstiness", "max_concurrency",
                         "duration", "completed", "failed", "total_input_tokens"]
    assert keys[14:32] == [
        "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
        "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies",
        "start_times", "queue_times", "generated_texts", "errors", "max_output_tokens_per_s",
        "max_concurrent_requests", "rtfx", "mean_ttft_ms"]
    assert keys[-6:] == ["mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p25_e2el_ms",
                         "p50_e2el_ms", "p99_e2el_ms"]
