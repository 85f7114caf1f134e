"""The timed part of the serving benchmark: the arrival schedule, the concurrency gate, the
ready check and warmups, and the summary (metrics, printed block, result fields).

Arrivals follow vLLM 0.33's benchmark client: all send times are drawn before the run from the
global numpy RNG (seeded with --seed), each request becomes an asyncio task at its send time, an
``asyncio.Semaphore(max_concurrency)`` gates the HTTP calls, and one keep-alive aiohttp session
(connection limit = max concurrency) carries everything.
"""

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from mlaserve.bench import serve_client as client
from mlaserve.bench import serve_metrics as report
from mlaserve.bench.serve_dataset import SampleRequest

SESSION_TIMEOUT_S = 6 * 60 * 60


def arrival_delays(
    num_requests: int,
    request_rate: float,
    burstiness: float,
    ramp_up: tuple[str, int, int] | None = None,
) -> tuple[list[float], list[float]]:
    """Send times (seconds after the start) and the rate in force, per request.

    Intervals are 0 at an infinite rate, 1/rate at infinite burstiness, otherwise
    ``np.random.gamma(burstiness, 1 / (rate * burstiness))`` from the global numpy RNG. Their
    cumulative sums are rescaled so the last send lands exactly at ``num_requests / rate``
    (not under ramp-up, where the rate moves linearly or geometrically from start to end).
    """
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    rates, delays = [], []
    for i in range(num_requests):
        rate = request_rate
        if ramp_up is not None:
            strategy, start_rps, end_rps = ramp_up
            progress = i / max(num_requests - 1, 1)
            if strategy == "linear":
                rate = start_rps + (end_rps - start_rps) * progress
            else:
                rate = start_rps * (end_rps / start_rps) ** progress
        if rate <= 0:
            raise ValueError(f"non-positive request rate {rate}")
        rates.append(rate)
        if rate == float("inf"):
            delays.append(0.0)
        elif burstiness == float("inf"):
            delays.append(1.0 / rate)
        else:
            delays.append(float(np.random.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))))
    for i in range(1, len(delays)):
        delays[i] += delays[i - 1]
    if ramp_up is None and delays and delays[-1] != 0:
        scale = (num_requests / request_rate) / delays[-1]
        delays = [d * scale for d in delays]
    return delays, rates


async def arrivals(
    requests: list[SampleRequest], delays: list[float], rates: list[float]
) -> AsyncIterator[tuple[SampleRequest, float]]:
    """Yield each request at ``start + delay`` (wall clock), with the rate in force."""
    start = time.time()
    for request, delay, rate in zip(requests, delays, rates, strict=True):
        if delay > 0 and (sleep_s := start + delay - time.time()) > 0:
            await asyncio.sleep(sleep_s)
        yield request, rate


@dataclass
class BenchmarkConfig:
    """Everything the timed run needs, resolved from the command line."""

    backend: str
    api_url: str
    base_url: str
    model_id: str
    model_name: str | None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ramp_up: tuple[str, int, int] | None = None
    ignore_eos: bool = True
    logprobs: int | None = None
    extra_headers: dict[str, str] | None = None
    extra_body: dict[str, Any] | None = None
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    percentiles: tuple[float, ...] = (99.0,)
    goodput_slos_ms: dict[str, float] | None = None
    num_warmups: int = 0
    ready_check_timeout_s: int = 0
    disable_tqdm: bool = False


def request_input(config: BenchmarkConfig, request: SampleRequest) -> client.RequestInput:
    """The HTTP request for one dataset entry."""
    return client.RequestInput(
        prompt=request.prompt,
        api_url=config.api_url,
        prompt_len=request.prompt_len,
        output_len=request.expected_output_len,
        model=config.model_id,
        model_name=config.model_name,
        logprobs=config.logprobs,
        extra_headers=config.extra_headers,
        extra_body=config.extra_body,
        ignore_eos=config.ignore_eos,
        request_id=request.request_id,
    )


async def benchmark(
    config: BenchmarkConfig, requests: list[SampleRequest], tokenizer: Any | None
) -> tuple[dict[str, Any], report.BenchmarkMetrics]:
    """Run the timed benchmark, print the result block; return the result fields and metrics."""
    request_func, _ = client.BACKENDS[config.backend]
    limit = config.max_concurrency or 0
    connector = aiohttp.TCPConnector(
        limit=limit, limit_per_host=limit, ttl_dns_cache=300, use_dns_cache=True,
        keepalive_timeout=60, force_close=False,
    )
    session = aiohttp.ClientSession(
        connector=connector, trust_env=True,
        timeout=aiohttp.ClientTimeout(total=SESSION_TIMEOUT_S),
    )
    try:
        return await _benchmark(config, requests, tokenizer, request_func, session)
    finally:
        await session.close()


def _semaphore(max_concurrency: int | None) -> Any:
    return asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()


async def _benchmark(
    config: BenchmarkConfig,
    requests: list[SampleRequest],
    tokenizer: Any | None,
    request_func: client.RequestFunc,
    session: aiohttp.ClientSession,
) -> tuple[dict[str, Any], report.BenchmarkMetrics]:
    test_input = replace(request_input(config, requests[0]), request_id=None)
    print("Starting initial single prompt test run...")
    if config.ready_check_timeout_s > 0:
        test_output = await client.wait_for_endpoint(
            request_func, test_input, session, config.ready_check_timeout_s
        )
        if not test_output.success:
            raise RuntimeError(
                "Initial test run failed - Please make sure benchmark arguments are correctly "
                f"specified. Error: {test_output.error}"
            )
        print("Initial test run completed.")
    else:
        print("Skipping endpoint ready check.")

    if config.num_warmups > 0:
        print(f"Warming up with {config.num_warmups} requests...")
        warmup_bar = None if config.disable_tqdm else tqdm(total=config.num_warmups)
        warmup_gate = _semaphore(config.max_concurrency)

        async def warmup() -> None:
            async with warmup_gate:
                await request_func(test_input, session)
            if warmup_bar is not None:
                warmup_bar.update(1)

        await asyncio.gather(*(warmup() for _ in range(config.num_warmups)))
        if warmup_bar is not None:
            warmup_bar.close()
        print("Warmup run completed.")

    print("Starting main benchmark run...")
    if config.ramp_up is not None:
        strategy, start_rps, end_rps = config.ramp_up
        print(f"Traffic ramp-up strategy: {strategy}.")
        print(f"Will increase RPS from {start_rps} to {end_rps} RPS over the duration of the "
              "benchmark.")
    else:
        print(f"Traffic request rate: {config.request_rate}")
    shape = "Poisson process" if config.burstiness == 1.0 else "Gamma distribution"
    print(f"Burstiness factor: {config.burstiness} ({shape})")
    print(f"Maximum request concurrency: {config.max_concurrency}")

    spec_before = await client.fetch_spec_decode_counters(config.base_url, session)
    delays, rates = arrival_delays(
        len(requests), config.request_rate, config.burstiness, config.ramp_up
    )
    bar = None if config.disable_tqdm else tqdm(total=len(requests))
    gate = _semaphore(config.max_concurrency)

    async def send(inp: client.RequestInput, arrival_time: float) -> client.RequestOutput:
        async with gate:
            output = await request_func(inp, session)
        output.client_queue_time = output.start_time - arrival_time
        if bar is not None:
            bar.update(1)
        return output

    rps_change_events: list[dict[str, Any]] = []
    last_int_rps = -1
    if config.ramp_up is not None:
        last_int_rps = config.ramp_up[1]
        rps_change_events.append({"rps": last_int_rps, "timestamp": datetime.now().isoformat()})

    start = time.perf_counter()
    tasks = []
    async for request, rate in arrivals(requests, delays, rates):
        if config.ramp_up is not None and int(rate) > last_int_rps:
            stamp = datetime.now().isoformat()
            rps_change_events += [
                {"rps": rps, "timestamp": stamp} for rps in range(last_int_rps + 1, int(rate) + 1)
            ]
            last_int_rps = int(rate)
        inp = request_input(config, request)
        tasks.append(asyncio.create_task(send(inp, time.perf_counter())))
    outputs: list[client.RequestOutput] = await asyncio.gather(*tasks)
    if bar is not None:
        bar.close()
    duration = time.perf_counter() - start

    spec_stats = client.spec_decode_stats(
        spec_before, await client.fetch_spec_decode_counters(config.base_url, session)
    )
    return summarize(config, outputs, duration, tokenizer, spec_stats, rps_change_events)


def summarize(
    config: BenchmarkConfig,
    outputs: list[client.RequestOutput],
    duration: float,
    tokenizer: Any | None,
    spec_stats: dict[str, Any] | None = None,
    rps_change_events: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], report.BenchmarkMetrics]:
    """Compute the metrics of a finished run and print the result block; return the result
    fields (in vLLM 0.33's key order, per-request lists included) and the metrics."""
    goodput = config.goodput_slos_ms or {}
    metrics = report.calculate_metrics(outputs, duration, tokenizer, goodput)
    failed = [o for o in outputs if not o.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, o in enumerate(failed[:10]):
            print(f"Error {i}: {o.error}")

    lines = report.summary_lines(
        metrics, duration_s=duration, max_concurrency=config.max_concurrency,
        request_rate=config.request_rate, has_tokenizer=tokenizer is not None,
        has_goodput=bool(goodput),
    )
    result: dict[str, Any] = {
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": metrics.output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "queue_times": [o.client_queue_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "rtfx": 0.0,
    }
    if rps_change_events:
        result["rps_change_events"] = rps_change_events
    if spec_stats is not None:
        result["spec_decode_acceptance_rate"] = spec_stats["acceptance_rate"]
        result["spec_decode_acceptance_length"] = spec_stats["acceptance_length"]
        result["spec_decode_num_drafts"] = int(spec_stats["num_drafts"])
        result["spec_decode_draft_tokens"] = int(spec_stats["draft_tokens"])
        result["spec_decode_accepted_tokens"] = int(spec_stats["accepted_tokens"])
        result["spec_decode_per_position_acceptance_rates"] = spec_stats[
            "per_position_acceptance_rates"
        ]

    queue_times = e2els_with_queue = None
    if config.max_concurrency is not None:
        queue_times = [o.client_queue_time for o in outputs if o.success]
        if not math.isinf(config.request_rate):
            e2els_with_queue = [o.latency + o.client_queue_time for o in outputs if o.success]
    sections = report.metric_sections(
        metrics, list(config.percentile_metrics), tokenizer is not None, queue_times,
        e2els_with_queue,
    )
    for section in sections:
        stats = report.distribution(section.values_s, list(config.percentiles))
        lines += report.section_lines(section, stats)
        result.update(report.section_results(section, stats))
    if spec_stats is not None:
        lines += report.spec_decode_lines(spec_stats)
    lines.append("=" * report.BLOCK_WIDTH)
    print("\n".join(lines))
    return result, metrics
