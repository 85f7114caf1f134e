"""Tests of `mlaserve bench serve` against a scripted OpenAI-compatible server on loopback.

The timed tests run client and server in one event loop whose clock is virtual: when nothing is
ready, the loop jumps straight to its next timer instead of waiting. ``time.perf_counter`` and
``time.time`` are pointed at that clock, so every TTFT, gap, latency and duration equals the
server's script exactly (delays are multiples of 1/128 s, exact in binary floating point).
"""

import argparse
import asyncio
import contextlib
import json
import re
import selectors
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from mlaserve.bench import serve, serve_metrics
from mlaserve.bench.serve_client import SSEBuffer, chat_token_text
from mlaserve.bench.serve_dataset import parse_range_ratio, sample_random_requests
from mlaserve.bench.serve_runner import arrival_delays

TICK = 1 / 128  # seconds; every scripted delay is a multiple of it
REAL_POLL_S = 0.02  # real time the loop waits for I/O before it jumps to the next timer


# ---------------------------------------------------------------------------------------------
# Virtual-time event loop


class _JumpingSelector(selectors.DefaultSelector):
    """Polls real I/O briefly; when nothing arrives, advances the loop clock by the timeout the
    loop asked for (the time to its next timer)."""

    advance: Callable[[float], None]

    def select(self, timeout: float | None = None) -> list:
        if timeout is not None and timeout <= 0:
            return super().select(0)
        events = super().select(REAL_POLL_S)
        if not events and timeout is not None:
            self.advance(timeout)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time() only moves when the loop would otherwise sleep."""

    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        self.now = 1024.0
        selector.advance = self._advance

    def time(self) -> float:
        return self.now

    def _advance(self, dt: float) -> None:
        self.now += dt


@pytest.fixture
def run_virtual(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Any], Any]]:
    """Run a coroutine on a VirtualTimeLoop with the benchmark's clocks pointed at it."""
    loop = VirtualTimeLoop()
    monkeypatch.setattr(time, "perf_counter", loop.time)
    monkeypatch.setattr(time, "time", loop.time)
    yield loop.run_until_complete
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                 "ALL_PROXY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------------------------
# Tiny tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small byte-level BPE tokenizer with a BOS post-processor, saved as a HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The alphabet is the corpus's characters only (no lone UTF-8 bytes), so decoded token soup
    # is valid text and the fix-up loop reaches the target length.
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  show_progress=False)
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "serving benchmarks measure latency and throughput of every request",
        "multi-head latent attention caches one compressed latent per token",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>") \
        .save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: str) -> Any:
    tok = serve.load_tokenizer(tokenizer_dir)
    assert tok.num_special_tokens_to_add() == 1
    return tok


# ---------------------------------------------------------------------------------------------
# Scripted server


@dataclass
class Plan:
    """How the server answers one request: status, TTFT, gaps between chunks (in ticks)."""

    ttft_ticks: int = 2
    gap_ticks: list[int] = field(default_factory=list)
    status: int = 200
    break_after: int | None = None  # drop the connection after this many chunks
    usage: bool = True


class FakeServer:
    """OpenAI-compatible streaming server that follows a per-request plan."""

    def __init__(self, tokenizer: Any, plan: Callable[[int, int], Plan], model_root: str = "",
                 tokenize_extra: int = 0, tokenize_status: int = 200) -> None:
        self.tokenizer = tokenizer
        self.plan = plan  # (request index, max_tokens) -> Plan
        self.model_root = model_root
        self.tokenize_extra = tokenize_extra
        self.tokenize_status = tokenize_status
        self.bodies: dict[int, dict[str, Any]] = {}
        self.headers: dict[int, Any] = {}
        self.detokenize_calls = 0
        self.untagged = 0
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_post("/detokenize", self.detokenize)
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        if "prompt" in body:
            return len(self.tokenizer(body["prompt"]).input_ids)  # counts the BOS
        return len(self.tokenizer(body["messages"][0]["content"][0]["text"]).input_ids)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "served-name", "object": "model",
                                         "root": self.model_root, "parent": None}]}
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        if self.tokenize_status != 200:
            return web.Response(status=self.tokenize_status)
        body = await request.json()
        assert body["add_special_tokens"] is False
        ids = self.tokenizer(body["prompt"], add_special_tokens=False).input_ids
        ids += [5] * self.tokenize_extra
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.detokenize_calls += 1
        return web.json_response({"prompt": f"detok-{len(body['tokens'])}"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        request_id = request.headers.get("x-request-id")
        index = int(request_id.rsplit("-", 1)[1]) if request_id else -1  # -1: test or warmup
        self.untagged += request_id is None
        self.bodies[index], self.headers[index] = body, request.headers.copy()
        chat = "messages" in body
        max_tokens = body["max_completion_tokens" if chat else "max_tokens"]
        plan = self.plan(index, max_tokens)
        if plan.status != 200:
            return web.Response(status=plan.status, text="scripted failure")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if chat:  # the role chunk carries no token and must not set TTFT
            await response.write(_sse({"choices": [{"index": 0, "delta": {
                "role": "assistant", "content": ""}, "finish_reason": None}]}))
        for k, ticks in enumerate([plan.ttft_ticks, *plan.gap_ticks]):
            if plan.break_after == k:
                request.transport.close()
                return response
            await asyncio.sleep(ticks * TICK)
            text = f" w{k}"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0,
                                                                            "text": text}
            await response.write(_sse({"id": "cmpl-1", "choices": [choice]}))
        if plan.usage:
            prompt_tokens = self.prompt_tokens(body)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1 + len(plan.gap_ticks),
                     "total_tokens": prompt_tokens + 1 + len(plan.gap_ticks)}
            await response.write(_sse({"id": "cmpl-1", "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def varied_plan(index: int, max_tokens: int) -> Plan:
    """Different TTFT and gaps per request; one chunk per token."""
    gaps = [1 + (index + k) % 3 for k in range(max_tokens - 1)]
    return Plan(ttft_ticks=2 + index, gap_ticks=gaps)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def bench_args(base_url: str, tokenizer_dir: str, *extra: str) -> argparse.Namespace:
    return parse_args([
        "--base-url", base_url, "--model", "tiny-model", "--tokenizer", tokenizer_dir,
        "--random-input-len", "16", "--random-output-len", "6", "--disable-tqdm",
        "--request-id-prefix", "bench-test-", *extra,
    ])


def run_against(run_virtual: Callable[[Any], Any], server: FakeServer,
                make_args: Callable[[str], argparse.Namespace], tokenizer: Any) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        base_url = await server.start()
        try:
            return await serve.run_benchmark(make_args(base_url), tokenizer=tokenizer)
        finally:
            await server.stop()

    return run_virtual(main())


def approx(value: Any) -> Any:
    return pytest.approx(value, rel=1e-12, abs=1e-12)


def expected_stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    values_any: Any = values or 0
    stats = {"mean": np.mean(values_any) * 1000, "median": np.median(values_any) * 1000,
             "std": np.std(values_any) * 1000}
    for p in percentiles:
        stats[f"p{int(p) if int(p) == p else p}"] = np.percentile(values_any, p) * 1000
    return stats


def assert_section(result: dict[str, Any], key: str, values: list[float],
                   percentiles: list[float]) -> None:
    for stat, value in expected_stats(values, percentiles).items():
        assert result[f"{stat}_{key}_ms"] == approx(value), (key, stat)


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


@contextlib.contextmanager
def server_thread(server: FakeServer) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=30)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


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
