"""Prometheus text exposition with vLLM's metric names.

The gauges come from the engine core's latest SchedulerStats; the token and finished-request
counters and the latency histograms are kept here, in the API process, from the IterationStats
that the engine client reports for every batch of outputs. Everything runs on the server's event
loop, so nothing here is locked.
"""

import bisect
from dataclasses import dataclass, field

from mlaserve.engine.core_client import IterationStats
from mlaserve.engine.messages import SchedulerStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        out += [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class ServerMetrics:
    """Counters and latency histograms of the requests served (a StatsRecorder)."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{model_name}",engine="0"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.itl = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def record(self, stats: IterationStats) -> None:
        self.prompt_tokens += stats.num_prompt_tokens
        self.generation_tokens += stats.num_generation_tokens
        for gap in stats.inter_token_latencies:
            self.itl.observe(gap)
        for request in stats.finished:
            self.finished[request.finish_reason] = self.finished.get(request.finish_reason, 0) + 1
            ttft = request.first_token_latency
            if ttft is not None:
                self.ttft.observe(ttft)
                if request.num_generation_tokens > 1:
                    self.tpot.observe((request.e2e_latency - ttft)
                                      / (request.num_generation_tokens - 1))
            self.e2e.observe(request.e2e_latency)

    def render(self, stats: SchedulerStats) -> str:
        lab = self.labels
        lines = []

        def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

        metric("vllm:num_requests_running", "gauge", "Requests in the running batch.",
               [f"vllm:num_requests_running{{{lab}}} {stats.num_running}"])
        metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
               [f"vllm:num_requests_waiting{{{lab}}} {stats.num_waiting}"])
        metric("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0-1).",
               [f"vllm:kv_cache_usage_perc{{{lab}}} {stats.kv_usage}"])
        metric("vllm:prompt_tokens_total", "counter", "Prompt tokens processed.",
               [f"vllm:prompt_tokens_total{{{lab}}} {self.prompt_tokens}"])
        metric("vllm:generation_tokens_total", "counter", "Tokens generated.",
               [f"vllm:generation_tokens_total{{{lab}}} {self.generation_tokens}"])
        metric("vllm:num_preemptions_total", "counter", "Preemptions (recompute).",
               [f"vllm:num_preemptions_total{{{lab}}} {stats.num_preemptions}"])
        metric("vllm:prefix_cache_queries_total", "counter", "Tokens looked up in the prefix "
               "cache.", [f"vllm:prefix_cache_queries_total{{{lab}}} {stats.prefix_queries}"])
        metric("vllm:prefix_cache_hits_total", "counter", "Tokens found in the prefix cache.",
               [f"vllm:prefix_cache_hits_total{{{lab}}} {stats.prefix_hits}"])
        metric("vllm:request_success_total", "counter", "Finished requests by reason.",
               [f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {n}'
                for reason, n in sorted(self.finished.items())])
        for name, hist, text in (
                ("vllm:time_to_first_token_seconds", self.ttft, "Time to first token."),
                ("vllm:request_time_per_output_token_seconds", self.tpot,
                 "Time per output token after the first."),
                ("vllm:inter_token_latency_seconds", self.itl, "Time between tokens."),
                ("vllm:e2e_request_latency_seconds", self.e2e, "End-to-end latency.")):
            metric(name, "histogram", text, hist.lines(name, lab))
        return "\n".join(lines) + "\n"
