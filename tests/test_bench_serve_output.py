"""`mlaserve bench serve`: the random dataset, the arrival schedule, the printed block and stream
parsing, and the result files (a scripted server, tests/bench_serve_util.py)."""

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlaserve.bench import serve, serve_metrics
from mlaserve.bench.serve_client import SSEBuffer, chat_token_text
from mlaserve.bench.serve_dataset import parse_range_ratio, sample_random_requests
from mlaserve.bench.serve_runner import arrival_delays
from tests.bench_serve_util import (
    FakeServer,
    Plan,
    approx,
    bench_args,
    parse_args,
    run_against,
    server_thread,
    varied_plan,
)

# the fixtures (run_virtual, tokenizer, tokenizer_dir) come from tests/bench_serve_util.py,
# a plugin of tests/conftest.py
pytestmark = pytest.mark.usefixtures("no_proxy")

# ---------------------------------------------------------------------------------------------
# (d) random dataset


def reference_prompts(tok: Any, n: int, input_len: int, output_len: int, ratio: float,
                      seed: int) -> list[tuple[str, int, int]]:
    """The published algorithm, written out plainly (no prefix)."""
    rng = np.random.default_rng(seed)
    real = input_len - tok.num_special_tokens_to_add()
    lo, hi = int(np.floor(real * (1 - ratio))), int(np.ceil(real * (1 + ratio)))
    in_lens = rng.integers(lo, hi + 1, size=n)
    out_lens = rng.integers(max(1, int(np.floor(output_len * (1 - ratio)))),
                            max(1, int(np.ceil(output_len * (1 + ratio)))) + 1, size=n)
    offsets = rng.integers(0, tok.vocab_size, size=n)
    allowed = np.array(sorted(set(range(tok.vocab_size)) - set(tok.all_special_ids)))
    out = []
    for i in range(n):
        ids = allowed[(offsets[i] + i + np.arange(in_lens[i])) % len(allowed)].tolist()
        for attempt in range(11):
            text = tok.decode(ids)
            ids = tok.encode(text, add_special_tokens=False)
            if attempt == 10 or len(ids) == in_lens[i]:
                break
            if len(ids) < in_lens[i]:
                ids += rng.integers(0, tok.vocab_size, size=in_lens[i] - len(ids)).tolist()
            else:
                ids = ids[: in_lens[i]]
        out.append((text, len(ids), int(out_lens[i])))
    return out


def test_random_dataset_follows_the_algorithm(tokenizer):
    kwargs = dict(num_requests=12, input_len=40, output_len=10, range_ratio=0.5)
    a = sample_random_requests(tokenizer, seed=7, request_id_prefix="p-", **kwargs)
    assert a == sample_random_requests(tokenizer, seed=7, request_id_prefix="p-", **kwargs)
    assert a != sample_random_requests(tokenizer, seed=8, request_id_prefix="p-", **kwargs)
    assert [r.request_id for r in a] == [f"p-{i}" for i in range(12)]
    expected = reference_prompts(tokenizer, 12, 40, 10, 0.5, seed=7)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in a] == expected
    real = 40 - 1  # one BOS is added by the server
    assert all(np.floor(real * 0.5) <= r.prompt_len <= np.ceil(real * 1.5) for r in a)
    assert all(5 <= r.expected_output_len <= 15 for r in a)
    assert len({r.prompt_len for r in a}) > 1
    for r in a:  # the prompt text re-encodes to exactly prompt_len tokens
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len


def test_random_dataset_lengths_hit_the_target(tokenizer):
    reqs = sample_random_requests(tokenizer, num_requests=20, input_len=33, output_len=4,
                                  range_ratio={"input": 0.0, "output": 0.0}, prefix_len=5, seed=0)
    assert all(r.prompt_len == 5 + 32 for r in reqs)
    assert all(r.expected_output_len == 4 for r in reqs)
    assert parse_range_ratio("0.25") == 0.25
    assert parse_range_ratio('{"input": 0.1, "output": 0.2}') == {"input": 0.1, "output": 0.2}
    with pytest.raises(ValueError):
        sample_random_requests(tokenizer, num_requests=1, input_len=8, output_len=4,
                               range_ratio=1.0)
    with pytest.raises(ValueError):
        sample_random_requests(tokenizer, num_requests=1, input_len=1, output_len=4)


def test_alignment_with_server_tokenizer(run_virtual, tokenizer, tokenizer_dir, capsys):
    server = FakeServer(tokenizer, varied_plan, tokenize_extra=2)
    run_against(run_virtual, server, lambda url: bench_args(
        url, tokenizer_dir, "--num-prompts", "3"), tokenizer)
    assert server.detokenize_calls == 3
    assert [server.bodies[i]["prompt"] for i in range(3)] == ["detok-15"] * 3
    assert "WARNING: tokenizer mismatch (server=17, expected=15), re-aligning prompts." \
        in capsys.readouterr().out

    server = FakeServer(tokenizer, varied_plan, tokenize_status=404)
    run_against(run_virtual, server, lambda url: bench_args(
        url, tokenizer_dir, "--num-prompts", "1"), tokenizer)
    assert "WARNING: /tokenize unavailable, skipping alignment." in capsys.readouterr().out


def test_arrival_schedule():
    np.random.seed(3)
    delays, rates = arrival_delays(50, 10.0, 1.0)
    np.random.seed(3)
    raw = np.cumsum([np.random.gamma(1.0, 0.1) for _ in range(50)])
    assert delays == approx((raw * (5.0 / raw[-1])).tolist())
    assert delays[-1] == approx(5.0) and delays[0] > 0 and rates == [10.0] * 50
    assert arrival_delays(3, float("inf"), 1.0)[0] == [0.0, 0.0, 0.0]
    assert arrival_delays(4, 4.0, float("inf"))[0] == [0.25, 0.5, 0.75, 1.0]
    _, ramp_rates = arrival_delays(3, float("inf"), float("inf"), ("linear", 2, 6))
    assert ramp_rates == [2.0, 4.0, 6.0]


# ---------------------------------------------------------------------------------------------
# (e) printed block layout and stream parsing


def test_printed_block_layout():
    m = serve_metrics.BenchmarkMetrics(
        completed=6, failed=0, total_input=250, total_output=48, request_throughput=18.62,
        request_goodput=18.62, output_throughput=148.98, total_token_throughput=924.93,
        ttfts=[], tpots=[], itls=[], e2els=[], max_output_tokens_per_s=48.0,
        max_concurrent_requests=6, output_lens=[8] * 6,
    )
    lines = serve_metrics.summary_lines(m, duration_s=0.3222, max_concurrency=2,
                                        request_rate=20.0, has_tokenizer=True, has_goodput=True)
    assert lines == [
        "============ Serving Benchmark Result ============",
        "Successful requests:                     6         ",
        "Failed requests:                         0         ",
        "Maximum request concurrency:             2         ",
        "Request rate configured (RPS):           20.00     ",
        "Benchmark duration (s):                  0.32      ",
        "Total input tokens:                      250       ",
        "Total generated tokens:                  48        ",
        "Request throughput (req/s):              18.62     ",
        "Request goodput (req/s):                 18.62     ",
        "Output token throughput (tok/s):         148.98    ",
        "Peak output token throughput (tok/s):    48.00     ",
        "Peak concurrent requests:                6.00      ",
        "Total token throughput (tok/s):          924.93    ",
    ]
    headers = {
        "Time to First Token": "---------------Time to First Token----------------",
        "Time per Output Token (excl. 1st token)":
            "-----Time per Output Token (excl. 1st token)------",
        "Inter-token Latency": "---------------Inter-token Latency----------------",
        "End-to-end Latency": "----------------End-to-end Latency----------------",
    }
    for title, expected in headers.items():
        assert serve_metrics.section_header(title, "-") == expected
    section = serve_metrics.MetricSection("ttft", "TTFT", "Time to First Token", [0.003, 0.004])
    stats = serve_metrics.distribution(section.values_s, [50.0, 99.9])
    assert serve_metrics.section_lines(section, stats) == [
        "---------------Time to First Token----------------",
        "Mean TTFT (ms):                          3.50      ",
        "Median TTFT (ms):                        3.50      ",
        "P50 TTFT (ms):                           3.50      ",
        "P99.9 TTFT (ms):                         4.00      ",
    ]
    assert list(serve_metrics.section_results(section, stats)) == [
        "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99.9_ttft_ms"]
    short = serve_metrics.summary_lines(m, duration_s=1.0, max_concurrency=None,
                                        request_rate=float("inf"), has_tokenizer=False,
                                        has_goodput=False)
    assert [line.split(":")[0] for line in short[1:]] == [
        "Successful requests", "Failed requests", "Benchmark duration (s)",
        "Total input tokens", "Request throughput (req/s)", "Peak concurrent requests"]


def test_printed_block_order_in_a_run(run_virtual, tokenizer, tokenizer_dir, capsys):
    run_against(run_virtual, FakeServer(tokenizer, varied_plan), lambda url: bench_args(
        url, tokenizer_dir, "--num-prompts", "2"), tokenizer)
    out = capsys.readouterr().out
    block = out[out.index("============ Serving Benchmark Result"):].splitlines()
    assert [line[:40].rstrip() for line in block] == [
        "============ Serving Benchmark Result ==", "Successful requests:", "Failed requests:",
        "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
        "Request throughput (req/s):", "Output token throughput (tok/s):",
        "Peak output token throughput (tok/s):", "Peak concurrent requests:",
        "Total token throughput (tok/s):", "---------------Time to First Token------",
        "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
        "-----Time per Output Token (excl. 1st to", "Mean TPOT (ms):", "Median TPOT (ms):",
        "P99 TPOT (ms):", "---------------Inter-token Latency------", "Mean ITL (ms):",
        "Median ITL (ms):", "P99 ITL (ms):", "=" * 40,
    ]
    assert all(len(line) == 51 for line in block if not line.startswith(("=", "-")))
    assert "Traffic request rate: inf\nBurstiness factor: 1.0 (Poisson process)\n" \
        "Maximum request concurrency: None\n" in out


def test_sse_buffer_and_chat_events():
    sse = SSEBuffer()
    assert sse.add(b'data: {"a": 1}\n\ndata: {"b"') == ['data: {"a": 1}']
    assert sse.add(b': 2}\n\n: keep-alive\n\ndata: [DONE]') == \
        ['data: {"b": 2}', ": keep-alive", "data: [DONE]"]
    assert sse.add(b'data: {"c": 3}') == ['data: {"c": 3}']  # complete JSON, no separator yet
    assert sse.add("data: \"\u00e9".encode()[:-1]) == []  # split inside a UTF-8 character
    assert chat_token_text({"delta": {"role": "assistant", "content": ""}}) is None
    assert chat_token_text({"delta": {"content": ""}}) == ""
    assert chat_token_text({"delta": {"reasoning": "hm"}}) == ""
    assert chat_token_text({"delta": {}}) is None


# ---------------------------------------------------------------------------------------------
# (f) result files, through run() with the server on a thread


def test_result_file_name_format():
    name = serve_metrics.result_filename(
        label=None, backend="openai", request_rate=float("inf"), max_concurrency=64,
        model_id="meta-llama/Llama-3-8B", date="20261202-110405")
    assert name == "openai-infqps-concurrency64-Llama-3-8B-20261202-110405.json"
    name = serve_metrics.result_filename(
        label="mla", backend="openai", request_rate=20.0, max_concurrency=None,
        model_id="/models/DeepSeek-V2-Lite", date="20261202-110405")
    assert name == "mla-20.0qps-DeepSeek-V2-Lite-20261202-110405.json"
    name = serve_metrics.result_filename(
        label=None, backend="vllm", request_rate=float("inf"), max_concurrency=None,
        model_id="m", date="d", ramp_up=("linear", 1, 8))
    assert name == "vllm-ramp-up-linear-1qps-8qps-m-d.json"


def test_run_saves_results_and_plot(tokenizer, tokenizer_dir, tmp_path):
    server = FakeServer(tokenizer, lambda i, n: Plan(ttft_ticks=1, gap_ticks=[1] * (n - 1)),
                        model_root=tokenizer_dir)
    with server_thread(server) as url:
        argv = ["--base-url", url, "--random-input-len", "12", "--random-output-len", "4",
                "--num-prompts", "4", "--max-concurrency", "2", "--disable-tqdm",
                "--save-result", "--result-dir", str(tmp_path), "--plot",
                "--metadata", "gpu=none", "tp = 1"]
        assert serve.run(parse_args(argv)) == 0
        files = sorted(p.name for p in tmp_path.iterdir())
        assert len(files) == 2 and files[0].endswith(".json") and files[1].endswith(".png")
        assert re.fullmatch(r"openai-infqps-concurrency2-tokenizer\d*-\d{8}-\d{6}\.json",
                            files[0])
        assert Path(tmp_path / files[1]).read_bytes()[:4] == b"\x89PNG"
        saved = json.loads((tmp_path / files[0]).read_text())
        assert saved["model_id"] == tokenizer_dir and saved["tokenizer_id"] == tokenizer_dir
        assert list(saved)[6:10] == ["num_prompts", "gpu", "tp", "request_rate"]
        assert "ttfts" not in saved and "latencies" in saved and saved["completed"] == 4
        assert server.bodies[0]["model"] == "served-name"

        append = ["--result-filename", "all.json", "--append-result"]
        for _ in range(2):
            assert serve.run(parse_args([*argv[:-6], "--result-dir", str(tmp_path), *append])) \
                == 0
        docs = (tmp_path / "all.json").read_text().split("\n")
        assert len(docs) == 2 and all(json.loads(d)["completed"] == 4 for d in docs)

    failing = FakeServer(tokenizer, lambda i, n: Plan(status=500), model_root=tokenizer_dir)
    with server_thread(failing) as url:
        argv = ["--base-url", url, "--random-input-len", "12", "--num-prompts", "2",
                "--disable-tqdm"]
        assert serve.run(parse_args(argv)) == 1
