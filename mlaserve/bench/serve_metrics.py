"""Serving benchmark metrics and reports, defined and laid out as vLLM 0.33's benchmark client
defines and prints them.

- TTFT, E2EL: per successful request. TPOT: ``(latency - ttft) / (output_len - 1)`` per request
  with more than one output token. ITL: every inter-chunk gap of every request, pooled.
- Statistics: ``np.mean``, ``np.median``, ``np.std`` (population), ``np.percentile`` (linear),
  in milliseconds; an empty list gives 0.
- Output length: the server's ``usage.completion_tokens``, else the tokenizer's count of the
  generated text (1 without a tokenizer); failed requests count 0.
- Peaks: token events (chunks) and active requests bucketed by whole seconds since the first
  request started; the busiest bucket of each.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np

from mlaserve.bench.serve_client import RequestOutput

MS_PER_S = 1000
LABEL_WIDTH = 40
VALUE_WIDTH = 10
BLOCK_WIDTH = 50
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class Distribution:
    """Summary statistics of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]


def distribution(values_s: list[float], percentiles: list[float]) -> Distribution:
    """Statistics of ``values_s`` (seconds) in ms; an empty list gives zeros."""
    values: Any = values_s or 0
    return Distribution(
        mean=float(np.mean(values)) * MS_PER_S,
        median=float(np.median(values)) * MS_PER_S,
        std=float(np.std(values)) * MS_PER_S,
        percentiles=[(p, float(np.percentile(values, p)) * MS_PER_S) for p in percentiles],
    )


@dataclass
class BenchmarkMetrics:
    """Run totals, throughputs and the per-metric samples (seconds) behind the distributions."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    ttfts: list[float]
    tpots: list[float]
    itls: list[float]
    e2els: list[float]
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: list[int]


def output_len_of(output: RequestOutput, tokenizer: Any | None) -> int:
    """Generated token count of a successful request: usage first, then the tokenizer."""
    if output.output_tokens:
        return output.output_tokens
    if tokenizer is None:
        return 1
    return len(tokenizer(output.generated_text, add_special_tokens=False).input_ids)


def peak_stats(outputs: list[RequestOutput]) -> tuple[float, int]:
    """Busiest one-second buckets since the earliest start: (token events, active requests).

    A request is active in every bucket from int(start) to int(end) inclusive; each of its
    1 + len(itl) chunks is a token event.
    """
    successful = [o for o in outputs if o.success]
    if not successful:
        return 0.0, 0
    t0 = min(o.start_time for o in successful)
    t_end = max(o.start_time + o.latency for o in successful)
    num_buckets = int(np.ceil(t_end - t0)) + 1
    tokens = np.zeros(num_buckets)
    active = np.zeros(num_buckets)
    for o in successful:
        t = o.start_time + o.ttft
        event_times = [t]
        for gap in o.itl:
            t += gap
            event_times.append(t)
        for t in event_times:
            bucket = int(t - t0)
            if 0 <= bucket < num_buckets:
                tokens[bucket] += 1
        first = int(o.start_time - t0)
        last = int(o.start_time + o.latency - t0)
        for bucket in range(first, min(last + 1, num_buckets)):
            active[bucket] += 1
    return float(np.max(tokens)), int(np.max(active))


def calculate_metrics(
    outputs: list[RequestOutput],
    duration_s: float,
    tokenizer: Any | None,
    goodput_slos_ms: dict[str, float],
) -> BenchmarkMetrics:
    """Aggregate per-request outputs into the run's metrics."""
    output_lens: list[int] = []
    total_input = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    goodput_tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        output_len = output_len_of(o, tokenizer)
        output_lens.append(output_len)
        total_input += o.prompt_len
        tpot = 0.0  # goodput treats single-token requests as TPOT 0
        if output_len > 1:
            tpot = (o.latency - o.ttft) / (output_len - 1)
            tpots.append(tpot)
        goodput_tpots.append(tpot)
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
    completed = len(ttfts)

    good = 0
    if goodput_slos_ms:
        samples = {"ttft": ttfts, "tpot": goodput_tpots, "e2el": e2els}
        checks = [(samples[k], v / MS_PER_S) for k, v in goodput_slos_ms.items()]
        for i in range(completed):
            good += all(values[i] <= slo for values, slo in checks)

    max_tokens_per_s, max_concurrent = peak_stats(outputs)
    total_output = sum(output_lens)
    return BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration_s,
        request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttfts=ttfts,
        tpots=tpots,
        itls=itls,
        e2els=e2els,
        max_output_tokens_per_s=max_tokens_per_s,
        max_concurrent_requests=max_concurrent,
        output_lens=output_lens,
    )


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        try:
            name, value = pair.split(":")
            slos[name] = float(value)
        except ValueError as exc:
            raise ValueError(
                f"invalid --goodput entry {pair!r}: use KEY:VALUE with the value in ms"
            ) from exc
        if name not in GOODPUT_METRICS:
            raise ValueError(f"invalid --goodput metric {name!r}: use one of {GOODPUT_METRICS}")
        if slos[name] < 0:
            raise ValueError(f"invalid --goodput value for {name}: it must be non-negative")
    return slos


# ---------------------------------------------------------------------------------------------
# The printed block


def section_header(title: str, fill: str) -> str:
    """``title`` centred in 50 characters of ``fill``; an odd leftover goes to the right."""
    return f"{title:{fill}^{BLOCK_WIDTH}}"


def value_line(label: str, value: float | int, as_float: bool = True) -> str:
    """``label.ljust(40) + " " + value.ljust(10)``; floats with two decimals."""
    text = f"{value:.2f}" if as_float else f"{value}"
    return f"{label:<{LABEL_WIDTH}} {text:<{VALUE_WIDTH}}"


def percentile_word(p: float) -> str:
    """``99.0 -> "99"``, ``99.9 -> "99.9"``."""
    return str(int(p)) if int(p) == p else str(p)


@dataclass(frozen=True)
class MetricSection:
    """One latency section of the report: key (``ttft``), short name, header and samples."""

    key: str
    name: str
    title: str
    values_s: list[float]


def metric_sections(
    metrics: BenchmarkMetrics,
    selected: list[str],
    has_tokenizer: bool,
    queue_times: list[float] | None,
    e2els_with_queue: list[float] | None,
) -> list[MetricSection]:
    """The latency sections to report, in report order, restricted to ``selected``."""
    sections = []
    if has_tokenizer:
        sections += [
            MetricSection("ttft", "TTFT", "Time to First Token", metrics.ttfts),
            MetricSection("tpot", "TPOT", "Time per Output Token (excl. 1st token)", metrics.tpots),
            MetricSection("itl", "ITL", "Inter-token Latency", metrics.itls),
        ]
    sections.append(MetricSection("e2el", "E2EL", "End-to-end Latency", metrics.e2els))
    if queue_times is not None:
        sections.append(MetricSection(
            "client_queue_time", "Client Queue Time", "Client-side Queueing", queue_times
        ))
    if e2els_with_queue is not None:
        sections.append(MetricSection(
            "e2el_including_client_queue", "E2EL incl. Client Queue",
            "Queue-inclusive End-to-end Latency", e2els_with_queue,
        ))
    return [s for s in sections if s.key in selected]


def summary_lines(
    metrics: BenchmarkMetrics,
    *,
    duration_s: float,
    max_concurrency: int | None,
    request_rate: float,
    has_tokenizer: bool,
    has_goodput: bool,
) -> list[str]:
    """The header and totals of the result block."""
    lines = [
        section_header(" Serving Benchmark Result ", "="),
        value_line("Successful requests:", metrics.completed, as_float=False),
        value_line("Failed requests:", metrics.failed, as_float=False),
    ]
    if max_concurrency is not None:
        lines.append(value_line("Maximum request concurrency:", max_concurrency, as_float=False))
    if request_rate != float("inf"):
        lines.append(value_line("Request rate configured (RPS):", request_rate))
    lines.append(value_line("Benchmark duration (s):", duration_s))
    lines.append(value_line("Total input tokens:", metrics.total_input, as_float=False))
    if has_tokenizer:
        lines.append(value_line("Total generated tokens:", metrics.total_output, as_float=False))
    lines.append(value_line("Request throughput (req/s):", metrics.request_throughput))
    if has_goodput:
        lines.append(value_line("Request goodput (req/s):", metrics.request_goodput))
    if has_tokenizer:
        lines.append(value_line("Output token throughput (tok/s):", metrics.output_throughput))
        lines.append(
            value_line("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s)
        )
    lines.append(value_line("Peak concurrent requests:", metrics.max_concurrent_requests))
    if has_tokenizer:
        lines.append(value_line("Total token throughput (tok/s):", metrics.total_token_throughput))
    return lines


def section_lines(section: MetricSection, stats: Distribution) -> list[str]:
    """One latency section: header, mean, median and the selected percentiles."""
    lines = [
        section_header(section.title, "-"),
        value_line(f"Mean {section.name} (ms):", stats.mean),
        value_line(f"Median {section.name} (ms):", stats.median),
    ]
    for p, value in stats.percentiles:
        lines.append(value_line(f"P{percentile_word(p)} {section.name} (ms):", value))
    return lines


def section_results(section: MetricSection, stats: Distribution) -> dict[str, float]:
    """One section's JSON keys: mean, median, std, then each percentile."""
    results = {
        f"mean_{section.key}_ms": stats.mean,
        f"median_{section.key}_ms": stats.median,
        f"std_{section.key}_ms": stats.std,
    }
    for p, value in stats.percentiles:
        results[f"p{percentile_word(p)}_{section.key}_ms"] = value
    return results


def spec_decode_lines(stats: dict[str, Any]) -> list[str]:
    """The Speculative Decoding section."""
    lines = [
        section_header("Speculative Decoding", "-"),
        value_line("Acceptance rate (%):", stats["acceptance_rate"]),
        value_line("Acceptance length:", stats["acceptance_length"]),
        value_line("Drafts:", int(stats["num_drafts"]), as_float=False),
        value_line("Draft tokens:", int(stats["draft_tokens"]), as_float=False),
        value_line("Accepted tokens:", int(stats["accepted_tokens"]), as_float=False),
    ]
    if per_pos := stats["per_position_acceptance_rates"]:
        lines.append("Per-position acceptance (%):")
        lines += [value_line(f"  Position {i}:", rate * 100) for i, rate in enumerate(per_pos)]
    return lines


# ---------------------------------------------------------------------------------------------
# Files


def result_filename(
    *,
    label: str | None,
    backend: str,
    request_rate: float,
    max_concurrency: int | None,
    model_id: str,
    date: str,
    ramp_up: tuple[str, int, int] | None = None,
) -> str:
    """``{label or backend}-{rate}qps[-concurrency{C}]-{basename(model_id)}-{date}.json``;
    with ramp-up ``{label}-ramp-up-{strategy}-{start}qps-{end}qps...``."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    rate = f"{request_rate}qps"
    if ramp_up is not None:
        rate = f"ramp-up-{ramp_up[0]}-{ramp_up[1]}qps-{ramp_up[2]}qps"
    return f"{label or backend}-{rate}{concurrency}-{model_id.split('/')[-1]}-{date}.json"


def save_distribution_plot(path: str, ttfts_s: list[float], tpots_s: list[float],
                           itls_s: list[float]) -> None:
    """Write a PNG with histograms of TTFT, TPOT and ITL (ms) side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    samples = (("TTFT", ttfts_s), ("TPOT", tpots_s), ("ITL", itls_s))
    for ax, (name, values) in zip(axes, samples, strict=True):
        values_ms = np.asarray(values, dtype=float) * MS_PER_S
        if values_ms.size:
            ax.hist(values_ms, bins=min(50, max(1, values_ms.size)))
            for p, style in ((50, "--"), (99, ":")):
                ax.axvline(np.percentile(values_ms, p), color="k", linestyle=style,
                           label=f"P{p} {np.percentile(values_ms, p):.2f} ms")
            ax.legend()
        ax.set_title(f"{name} ({values_ms.size} samples)")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
