"""ServerMetrics: vLLM's metric names and labels, values after recorded iterations, the log line."""

from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlaserve.engine.core_client import FinishedRequestStats, IterationStats
from mlaserve.engine.messages import SchedulerStats
from mlaserve.server.metrics import ServerMetrics, build_1_2_5_buckets

LABELS = {"model_name": "demo", "engine": "0"}

VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by name and sorted labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({**LABELS, **labels}.items())))
    found = samples(text)
    assert key in found, f"{key} not in the exposition"
    return found[key]


def bucket(text: str, name: str, le: str) -> float:
    return value(text, name + "_bucket", le=le)


def finished(reason: str, prompt: int, generated: int, ttft: float | None,
             e2e: float) -> FinishedRequestStats:
    return FinishedRequestStats(reason, prompt, generated, ttft, e2e)


def served() -> ServerMetrics:
    """Three requests: two that ran to their length, one aborted before its first token."""
    metrics = ServerMetrics("demo")
    metrics.record(IterationStats(num_prompt_tokens=3 + 5, num_generation_tokens=2))
    metrics.record(IterationStats(num_generation_tokens=2, inter_token_latencies=[0.03, 0.1]))
    metrics.record(IterationStats(
        num_generation_tokens=2, inter_token_latencies=[0.2, 0.01],
        finished=[finished("length", 3, 3, 0.05, 0.5), finished("length", 5, 3, 1.5, 1.9)]))
    metrics.record(IterationStats(finished=[finished("abort", 7, 0, None, 0.7)]))
    return metrics


def test_families_have_vllm_names_types_and_labels():
    text = ServerMetrics("demo").render(SchedulerStats())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {name: families[name].type for name in VLLM_FAMILIES} == VLLM_FAMILIES
    for family in families.values():
        assert family.samples, family.name
        for sample in family.samples:
            assert {k: sample.labels[k] for k in LABELS} == LABELS, sample
    assert "_created" not in text
    # The exposition names of counters carry _total, as vLLM's do.
    assert 'vllm:prompt_tokens_total{engine="0",model_name="demo"} 0.0' in text.splitlines()


def test_counters_after_recorded_iterations():
    text = served().render(SchedulerStats())
    assert value(text, "vllm:prompt_tokens_total") == 8
    assert value(text, "vllm:generation_tokens_total") == 6
    success = {reason: value(text, "vllm:request_success_total", finished_reason=reason)
               for reason in ("stop", "length", "abort")}
    assert success == {"stop": 0, "length": 2, "abort": 1}


def test_an_unknown_finish_reason_gets_its_own_label():
    metrics = ServerMetrics("demo")
    metrics.record(IterationStats(finished=[finished("timeout", 1, 0, None, 0.1)]))
    text = metrics.render(SchedulerStats())
    assert value(text, "vllm:request_success_total", finished_reason="timeout") == 1


def test_latency_histograms_count_sum_and_buckets():
    text = served().render(SchedulerStats())
    ttft = "vllm:time_to_first_token_seconds"
    assert value(text, ttft + "_count") == 2  # the aborted request had no first token
    assert value(text, ttft + "_sum") == pytest.approx(1.55)
    assert (bucket(text, ttft, "0.04"), bucket(text, ttft, "0.06")) == (0, 1)
    assert (bucket(text, ttft, "1.0"), bucket(text, ttft, "2.5")) == (1, 2)
    assert bucket(text, ttft, "+Inf") == 2

    itl = "vllm:inter_token_latency_seconds"
    assert value(text, itl + "_count") == 4
    assert value(text, itl + "_sum") == pytest.approx(0.34)
    # Bounds are inclusive: 0.1 falls in le="0.1", 0.01 in le="0.01".
    assert [bucket(text, itl, le) for le in ("0.01", "0.025", "0.05", "0.075", "0.1", "0.15",
                                             "0.2", "+Inf")] == [1, 1, 2, 2, 3, 3, 4, 4]

    e2e = "vllm:e2e_request_latency_seconds"
    assert value(text, e2e + "_count") == 3
    assert value(text, e2e + "_sum") == pytest.approx(3.1)
    assert [bucket(text, e2e, le) for le in ("0.3", "0.5", "0.8", "1.5", "2.0")] == [0, 1, 2, 2, 3]


def test_decode_time_and_time_per_output_token_of_requests_that_finished_on_a_token():
    text = served().render(SchedulerStats())
    decode = "vllm:request_decode_time_seconds"
    assert value(text, decode + "_count") == 2  # not the aborted one
    assert value(text, decode + "_sum") == pytest.approx(0.45 + 0.4)
    tpot = "vllm:request_time_per_output_token_seconds"
    assert value(text, tpot + "_count") == 2
    assert value(text, tpot + "_sum") == pytest.approx(0.45 / 2 + 0.4 / 2)
    assert (bucket(text, tpot, "0.2"), bucket(text, tpot, "0.3")) == (1, 2)
    # Queue, prefill and inference times need the core's scheduling time: not reported here.
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_params_max_tokens"):
        assert value(text, name + "_count") == 0, name


def test_token_count_histograms():
    text = served().render(SchedulerStats())
    prompt = "vllm:request_prompt_tokens"
    assert (value(text, prompt + "_count"), value(text, prompt + "_sum")) == (3, 15)
    assert [bucket(text, prompt, le) for le in ("2.0", "5.0", "10.0")] == [0, 2, 3]
    generation = "vllm:request_generation_tokens"
    assert (value(text, generation + "_count"), value(text, generation + "_sum")) == (3, 6)
    assert [bucket(text, generation, le) for le in ("1.0", "5.0")] == [1, 3]
    # One observation per reported step, of its prompt + generated tokens; an abort is no step.
    steps = "vllm:iteration_tokens_total"
    assert (value(text, steps + "_count"), value(text, steps + "_sum")) == (3, 14)
    assert [bucket(text, steps, le) for le in ("1.0", "8.0", "16.0")] == [0, 2, 3]


def test_token_buckets_follow_max_model_len():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-3:] == [500, 1000, 2000]
    text = ServerMetrics("demo", max_model_len=100).render(SchedulerStats())
    les = [s.labels["le"] for f in text_string_to_metric_families(text)
           if f.name == "vllm:request_prompt_tokens" for s in f.samples
           if s.name.endswith("_bucket")]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]


@dataclass
class PhasedRequestStats(FinishedRequestStats):
    """A finished request with the phase times that vLLM's engine reports."""

    queued_time: float = 0.0
    prefill_time: float = 0.0
    inference_time: float = 0.0
    decode_time: float = 0.0
    max_tokens_param: int = 0


def test_phase_times_fill_their_histograms_when_reported():
    metrics = ServerMetrics("demo")
    metrics.record(IterationStats(finished=[PhasedRequestStats(
        "abort", 4, 3, 0.5, 2.0, queued_time=0.4, prefill_time=0.09, inference_time=1.2,
        decode_time=1.1, max_tokens_param=64)]))
    text = metrics.render(SchedulerStats())
    for name, observed in (("vllm:request_queue_time_seconds", 0.4),
                           ("vllm:request_prefill_time_seconds", 0.09),
                           ("vllm:request_inference_time_seconds", 1.2),
                           ("vllm:request_decode_time_seconds", 1.1),  # reported: abort too
                           ("vllm:request_time_per_output_token_seconds", 0.55),
                           ("vllm:request_params_max_tokens", 64)):
        assert value(text, name + "_count") == 1, name
        assert value(text, name + "_sum") == pytest.approx(observed), name
    assert bucket(text, "vllm:request_params_max_tokens", "50.0") == 0
    assert bucket(text, "vllm:request_params_max_tokens", "100.0") == 1


def test_scheduler_gauges_and_counters_come_from_the_stats_rendered():
    metrics = ServerMetrics("demo")
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_usage=0.25, num_preemptions=1,
                           prefix_queries=96, prefix_hits=64)
    text = metrics.render(stats)
    assert value(text, "vllm:num_requests_running") == 3
    assert value(text, "vllm:num_requests_waiting") == 2
    assert value(text, "vllm:kv_cache_usage_perc") == 0.25
    assert value(text, "vllm:num_preemptions_total") == 1
    assert value(text, "vllm:prefix_cache_queries_total") == 96
    assert value(text, "vllm:prefix_cache_hits_total") == 64
    later = metrics.render(SchedulerStats(prefix_queries=100, prefix_hits=64))
    assert value(later, "vllm:num_requests_running") == 0
    assert value(later, "vllm:prefix_cache_queries_total") == 100


def test_servers_in_one_process_keep_their_own_registries():
    first, second = ServerMetrics("demo"), ServerMetrics("other")
    first.record(IterationStats(num_prompt_tokens=5, num_generation_tokens=1))
    assert value(first.render(SchedulerStats()), "vllm:prompt_tokens_total") == 5
    other = second.render(SchedulerStats())
    assert value(other, "vllm:prompt_tokens_total", model_name="other") == 0
    assert 'model_name="demo"' not in other


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stats_line_reports_the_interval_since_the_previous_call():
    clock = Clock()
    metrics = ServerMetrics("demo", clock=clock)
    metrics.record(IterationStats(num_prompt_tokens=100, num_generation_tokens=4))
    metrics.record(IterationStats(num_generation_tokens=16))
    clock.now += 10.0
    line = metrics.stats_line(SchedulerStats(num_running=4, num_waiting=1, kv_usage=0.125,
                                             prefix_queries=200, prefix_hits=50))
    assert line == ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: "
                    "2.0 tokens/s, Running: 4 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, "
                    "Prefix cache hit rate: 25.0%")
    assert not metrics.interval_was_idle

    # The next interval counts only what came after: 5 s, 10 generated tokens, 100 of the
    # 200 new queried tokens hit.
    metrics.record(IterationStats(num_generation_tokens=10))
    clock.now += 5.0
    line = metrics.stats_line(SchedulerStats(num_running=1, prefix_queries=400,
                                             prefix_hits=150))
    assert line == ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
                    "2.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
                    "Prefix cache hit rate: 50.0%")

    clock.now += 5.0
    line = metrics.stats_line(SchedulerStats(prefix_queries=400, prefix_hits=150))
    assert line.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
                           "0.0 tokens/s")
    assert line.endswith("Prefix cache hit rate: 0.0%")  # no query in the interval
    assert not metrics.interval_was_idle  # the interval before had tokens
    clock.now += 5.0
    metrics.stats_line(SchedulerStats(prefix_queries=400, prefix_hits=150))
    assert metrics.interval_was_idle


def test_stats_line_of_an_empty_interval():
    clock = Clock()
    metrics = ServerMetrics("demo", clock=clock)
    assert metrics.stats_line(SchedulerStats()) == (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
        "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")


def test_request_groups_record_n_and_their_longest_sample():
    metrics = ServerMetrics("demo", max_model_len=100)
    first, second = metrics.request_group(2), metrics.request_group(1)
    first.sample_ended(3)
    text = metrics.render(SchedulerStats())
    assert value(text, "vllm:request_params_n_count") == 2
    assert value(text, "vllm:request_params_n_sum") == 3
    assert bucket(text, "vllm:request_params_n", "1.0") == 1
    assert value(text, "vllm:request_max_num_generation_tokens_count") == 0  # one sample left
    first.sample_ended(7)
    second.sample_ended(4)
    text = metrics.render(SchedulerStats())
    assert value(text, "vllm:request_max_num_generation_tokens_count") == 2
    assert value(text, "vllm:request_max_num_generation_tokens_sum") == 7 + 4
    assert bucket(text, "vllm:request_max_num_generation_tokens", "5.0") == 1


def test_cache_config_info_is_one_labelled_with_the_settings():
    metrics = ServerMetrics("demo")
    metrics.set_cache_config({"block_size": 64, "cache_dtype": "auto", "num_gpu_blocks": 10,
                              "num_cpu_blocks": None})
    found = samples(metrics.render(SchedulerStats()))
    key = ("vllm:cache_config_info", tuple(sorted({
        "block_size": "64", "cache_dtype": "auto", "num_gpu_blocks": "10",
        "num_cpu_blocks": "None", "engine": "0"}.items())))
    assert found[key] == 1


def test_a_speculating_engine_publishes_vllms_spec_decode_counters_and_logs_them():
    assert "spec_decode" not in ServerMetrics("demo").render(SchedulerStats())  # not speculating
    metrics = ServerMetrics("demo", clock=lambda: 0.0, num_speculative_tokens=3)
    before_any_step = metrics.render(SchedulerStats())
    assert value(before_any_step, "vllm:spec_decode_num_drafts_total") == 0
    assert value(before_any_step, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 position="2") == 0
    stats = SchedulerStats(spec_num_drafts=10, spec_num_draft_tokens=30,
                           spec_num_accepted_tokens=18, spec_accepted_per_pos=[9, 6, 3])
    text = metrics.render(stats)
    assert value(text, "vllm:spec_decode_num_drafts_total") == 10
    assert value(text, "vllm:spec_decode_num_draft_tokens_total") == 30
    assert value(text, "vllm:spec_decode_num_accepted_tokens_total") == 18
    per_pos = {s.labels["position"]: s.value
               for family in text_string_to_metric_families(text)
               if family.name == "vllm:spec_decode_num_accepted_tokens_per_pos"
               for s in family.samples if s.name.endswith("_total")}
    assert per_pos == {"0": 9, "1": 6, "2": 3}
    metrics.stats_line(SchedulerStats(spec_accepted_per_pos=[0, 0, 0]))
    line = metrics.stats_line(stats)
    assert line.endswith(", SpecDecoding: mean acceptance length 2.80, accepted 18 of 30 draft "
                         "tokens (60.0%), per position 0.90, 0.60, 0.30")
    assert "SpecDecoding" not in metrics.stats_line(stats)  # no drafts in that interval
