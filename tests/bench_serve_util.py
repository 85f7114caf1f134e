"""The scripted OpenAI-compatible server, the virtual-time event loop and the tiny tokenizer that
the `mlaserve bench serve` tests share; tests/conftest.py loads it as a plugin for its fixtures.

The timed tests run client and server in one event loop whose clock is virtual: when nothing is
ready, the loop jumps straight to its next timer instead of waiting. ``time.perf_counter`` and
``time.time`` are pointed at that clock, so every TTFT, gap, latency and duration equals the
server's script exactly (delays are multiples of 1/128 s, exact in binary floating point).
"""

import argparse
import asyncio
import contextlib
import json
import selectors
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from mlaserve.bench import serve

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


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxy settings or API key from the environment reach the benchmark client."""
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
