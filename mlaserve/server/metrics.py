"""Prometheus metrics with vLLM's names and labels, and vLLM's periodic stats log line.

Every family carries the labels `model_name` (the served model name) and `engine` ("0"), as vLLM's
do, and lives in a `CollectorRegistry` of its own per `ServerMetrics`, so several servers can run
in one process. prometheus_client writes the text exposition.

Two sources feed it:

- The `IterationStats` that the engine client reports for every message of the core (and for
  every abort), through `record`: token counters, tokens per step, inter-token latencies and, per
  finished request, the success counter by finish reason and the per-request histograms.
- The core's latest `SchedulerStats`, given to `render`: the running / waiting / KV-usage gauges
  and the core's cumulative preemption and prefix-cache counters, exposed as they are by a
  collector rather than re-counted here.

Per-request phases. The client knows a request's arrival, first token and finish, so TTFT,
end-to-end latency, decode time (first token to last) and time per output token come from them;
decode time and time per output token are taken only for requests that finished on a token
("stop", "length"), whose finish time is their last token's. The queue / prefill / inference
split needs the time the core first scheduled the request, which the client does not see: a
`FinishedRequestStats` that carries `queued_time`, `prefill_time`, `inference_time` (and
`decode_time`, `max_tokens_param`), as vLLM's does, fills those histograms; one without them
leaves them empty. As in vLLM, counters and histograms carry no `_created` series (a
process-wide setting of prometheus_client). Everything runs on the server's event loop.

Request groups. The server runs a prompt's n samples (or best_of) as n engine requests, so the
API layer reports each group (`request_group`): its size at arrival (`vllm:request_params_n`)
and, once every sample has ended, the most tokens one of them generated
(`vllm:request_max_num_generation_tokens`). `set_cache_config` publishes the latent cache's
settings as `vllm:cache_config_info` (a gauge of 1 whose labels are the settings).
"""

import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlaserve.engine.core_client import FinishedRequestStats, IterationStats
from mlaserve.engine.messages import SchedulerStats
from mlaserve.engine.speculative import SpecDecodeStats

LABEL_NAMES = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
DEFAULT_MAX_MODEL_LEN = 1 << 20

# No `_created` series beside the counters and histograms (process-wide, as vLLM does).
disable_created_metrics()


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class _SchedulerStatsCollector(Collector):
    """The core's gauges and cumulative counters, as of the SchedulerStats last given."""

    def __init__(self, label_values: Sequence[str], num_speculative_tokens: int = 0) -> None:
        self.label_values = list(label_values)
        self.stats = SchedulerStats()
        self.num_speculative_tokens = num_speculative_tokens  # k; 0: no spec-decode counters

    def _families(self, stats: SchedulerStats | None) -> list[Metric]:
        families: list[Metric] = []
        for name, text, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.",
                 None if stats is None else stats.num_running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 None if stats is None else stats.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 None if stats is None else stats.kv_usage)):
            gauge = GaugeMetricFamily(name, text, labels=LABEL_NAMES)
            if value is not None:
                gauge.add_metric(self.label_values, value)
            families.append(gauge)
        for name, text, value in (
                ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                 None if stats is None else stats.num_preemptions),
                ("vllm:prefix_cache_queries",
                 "Prefix cache queries, in terms of number of queried tokens.",
                 None if stats is None else stats.prefix_queries),
                ("vllm:prefix_cache_hits",
                 "Prefix cache hits, in terms of number of cached tokens.",
                 None if stats is None else stats.prefix_hits)):
            counter = CounterMetricFamily(name, text, labels=LABEL_NAMES)
            if value is not None:
                counter.add_metric(self.label_values, value)
            families.append(counter)
        if stats is not None and self.num_speculative_tokens:  # a speculating engine's
            families += self._spec_families(stats)
        return families

    def _spec_families(self, stats: SchedulerStats) -> list[Metric]:
        """vLLM's speculative-decoding counters (`vllm:spec_decode_*`)."""
        families: list[Metric] = []
        for name, text, value in (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                 stats.spec_num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                 stats.spec_num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                 stats.spec_num_accepted_tokens)):
            counter = CounterMetricFamily(name, text, labels=LABEL_NAMES)
            counter.add_metric(self.label_values, value)
            families.append(counter)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=(*LABEL_NAMES, "position"))
        accepted = stats.spec_accepted_per_pos or [0] * self.num_speculative_tokens  # no step yet
        for position, value in enumerate(accepted):
            per_pos.add_metric([*self.label_values, str(position)], value)
        families.append(per_pos)
        return families

    def describe(self) -> Iterable[Metric]:
        """The families without samples (the registry checks names with this)."""
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        """The families with the values of the latest stats."""
        return self._families(self.stats)


class ServerMetrics:
    """vLLM's Prometheus metrics for one served model (a StatsRecorder for the engine client).

    max_model_len sets the top bucket of the token-count histograms, as in vLLM; the default
    covers any length. clock is the time source of `stats_line`'s intervals.
    """

    def __init__(self, model_name: str, *, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 clock: Callable[[], float] = time.monotonic,
                 num_speculative_tokens: int = 0) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label_values = (model_name, "0")
        self._scheduler = _SchedulerStatsCollector(label_values, num_speculative_tokens)
        self.registry.register(self._scheduler)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, LABEL_NAMES, registry=self.registry).labels(*label_values)

        def histogram(name: str, text: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, text, LABEL_NAMES, registry=self.registry,
                             buckets=buckets).labels(*label_values)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABEL_NAMES, "finished_reason"), registry=self.registry)
        self._success_family = success
        self._label_values = label_values
        self.request_success = {reason: success.labels(*label_values, reason)
                                for reason in FINISH_REASONS}

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets)
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.",
            REQUEST_PARAMS_N_BUCKETS)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", TPOT_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     REQUEST_LATENCY_BUCKETS)

        # Since the previous stats_line.
        self._clock = clock
        self._interval_start = clock()
        self._interval_prompt_tokens = 0
        self._interval_generation_tokens = 0
        self._last_stats = SchedulerStats()
        self._last_throughputs = (0.0, 0.0)
        self.interval_was_idle = True

    def record(self, stats: IterationStats) -> None:
        """Count what one message of the core (or one abort) added."""
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self._interval_prompt_tokens += stats.num_prompt_tokens
        self._interval_generation_tokens += stats.num_generation_tokens
        step_tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if step_tokens > 0:  # an abort reports no step
            self.iteration_tokens.observe(step_tokens)
        for gap in stats.inter_token_latencies:
            self.itl.observe(gap)
        for request in stats.finished:
            self._record_finished(request)

    def _record_finished(self, request: FinishedRequestStats) -> None:
        reason = request.finish_reason
        if reason not in self.request_success:
            self.request_success[reason] = self._success_family.labels(*self._label_values,
                                                                       reason)
        self.request_success[reason].inc()
        self.e2e.observe(request.e2e_latency)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_generation_tokens)
        ttft = request.first_token_latency
        if ttft is not None:
            self.ttft.observe(ttft)
        decode = _optional(request, "decode_time")
        if decode is None and ttft is not None and reason != "abort":
            decode = request.e2e_latency - ttft  # the finish came with the last token
        if decode is not None:
            self.decode_time.observe(decode)
            if request.num_generation_tokens > 1:
                self.tpot.observe(decode / (request.num_generation_tokens - 1))
        for field_name, hist in (("queued_time", self.queue_time),
                                 ("prefill_time", self.prefill_time),
                                 ("inference_time", self.inference_time),
                                 ("max_tokens_param", self.request_params_max_tokens)):
            value = _optional(request, field_name)
            if value is not None:
                hist.observe(value)

    def request_group(self, n: int) -> "RequestGroup":
        """A prompt's n samples have arrived; the group records its longest sample once every
        sample has ended."""
        self.request_params_n.observe(n)
        return RequestGroup(self, n)

    def set_cache_config(self, settings: dict[str, object]) -> None:
        """`vllm:cache_config_info`: 1, labelled with each cache setting (as text) and the
        engine, as vLLM publishes its CacheConfig."""
        labels = {name: str(value) for name, value in settings.items()}
        labels["engine"] = "0"
        gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                      tuple(labels), registry=self.registry)
        gauge.labels(**labels).set(1)

    def render(self, stats: SchedulerStats) -> str:
        """The Prometheus text exposition, with the core's gauges and counters from `stats`."""
        self._scheduler.stats = stats
        return generate_latest(self.registry).decode()

    def stats_line(self, stats: SchedulerStats) -> str:
        """vLLM's periodic log line over the interval since the previous call (or since start).

        Throughputs are the tokens recorded in the interval over its length; the prefix cache
        hit rate is the hits over the queries the core counted in the interval (0 without
        queries). Afterwards `interval_was_idle` says whether this interval and the one before
        it had no tokens (vLLM then logs the line at debug level only).
        """
        now = self._clock()
        elapsed = now - self._interval_start
        prompt_tps = self._interval_prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation_tps = self._interval_generation_tokens / elapsed if elapsed > 0 else 0.0
        queries = stats.prefix_queries - self._last_stats.prefix_queries
        hits = stats.prefix_hits - self._last_stats.prefix_hits
        hit_rate = hits / queries if queries > 0 else 0.0
        self.interval_was_idle = not any((prompt_tps, generation_tps, *self._last_throughputs))
        self._last_throughputs = (prompt_tps, generation_tps)
        self._interval_start = now
        self._interval_prompt_tokens = self._interval_generation_tokens = 0
        line = (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
                f"Avg generation throughput: {generation_tps:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {stats.kv_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {hit_rate * 100:.1f}%")
        line += _spec_summary(self._last_stats, stats)
        self._last_stats = stats
        return line


def _spec_counters(stats: SchedulerStats) -> SpecDecodeStats:
    return SpecDecodeStats(stats.spec_accepted_per_pos, stats.spec_num_drafts,
                           stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)


def _spec_summary(before: SchedulerStats, now: SchedulerStats) -> str:
    """The stats line's speculative-decoding part over an interval with drafts (else "")."""
    spec = _spec_counters(now).since(_spec_counters(before))
    if spec.num_drafts <= 0:
        return ""
    accepted, draft_tokens = spec.num_accepted_tokens, spec.num_draft_tokens
    per_pos = ", ".join(f"{rate:.2f}" for rate in spec.acceptance_per_pos)
    return (f", SpecDecoding: mean acceptance length {spec.mean_acceptance_length:.2f}, "
            f"accepted {accepted} of {draft_tokens} draft tokens "
            f"({accepted / max(draft_tokens, 1) * 100:.1f}%), per position {per_pos}")


class RequestGroup:
    """The samples of one prompt (see the module docstring); `sample_ended` once per sample."""

    def __init__(self, metrics: ServerMetrics, n: int) -> None:
        self.metrics = metrics
        self.samples_left = n
        self.most_tokens = 0

    def sample_ended(self, num_generation_tokens: int) -> None:
        self.most_tokens = max(self.most_tokens, num_generation_tokens)
        self.samples_left -= 1
        if self.samples_left == 0:
            self.metrics.request_max_num_generation_tokens.observe(self.most_tokens)


def _optional(request: FinishedRequestStats, name: str) -> float | None:
    """A per-request field that only some engine clients report (None when absent)."""
    return getattr(request, name, None)

