"""``mlaserve bench serve``: the online serving benchmark client.

It reproduces vLLM 0.33's ``vllm bench serve`` (random, sharegpt and custom datasets) so that
numbers compare 1:1: the same prompts for the same tokenizer, file and seed, the same request
bodies, arrival schedule, stream parsing, metric definitions, printed "Serving Benchmark Result"
block and result JSON.

Flow: list the model (without --model) -> load the tokenizer from a local path -> draw the
dataset -> align it with the server's /tokenize -> optional ready check and warmups -> the timed
run (arrivals by schedule, an asyncio.Semaphore for --max-concurrency) -> metrics -> report.
``run_benchmark(args)`` is the in-process entry point and returns the result dict.
"""

import argparse
import asyncio
import gc
import json
import random
import traceback
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from mlaserve.arg_types import json_object
from mlaserve.bench import serve_client as client
from mlaserve.bench import serve_metrics as report
from mlaserve.bench.serve_dataset import (
    SampleRequest,
    parse_range_ratio,
    sample_custom_requests,
    sample_random_requests,
    sample_sharegpt_requests,
)
from mlaserve.bench.serve_runner import BenchmarkConfig, benchmark

DATASETS = ("random", "sharegpt", "custom")

DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"
PERCENTILE_METRICS = (
    "ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue"
)
DETAILED_FIELDS = (
    "input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"
)
SAMPLING_FLAGS = (
    "top_p", "top_k", "min_p", "temperature",
    "frequency_penalty", "presence_penalty", "repetition_penalty",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the flags of ``mlaserve bench serve`` (vLLM 0.33 names and defaults)."""
    target = parser.add_argument_group("server")
    target.add_argument("--backend", default="openai", choices=list(client.BACKENDS),
                        help="openai/vllm: /v1/completions; openai-chat: /v1/chat/completions")
    target.add_argument("--base-url", default=None, help="server base URL (overrides host/port)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument("--endpoint", default="/v1/completions", help="API path")
    target.add_argument("--header", metavar="KEY=VALUE", nargs="*",
                        help="extra HTTP headers for every request")
    target.add_argument("--model", default=None,
                        help="model name; default: the first model of GET /v1/models")
    target.add_argument("--served-model-name", default=None,
                        help="name sent in the body (default: --model)")
    target.add_argument("--tokenizer", default=None,
                        help="local tokenizer path (default: the model path)")
    target.add_argument("--trust-remote-code", action="store_true")
    target.add_argument("--ready-check-timeout-sec", type=int, default=0,
                        help="retry a test request until it succeeds (0: skip the check)")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=DATASETS)
    data.add_argument("--dataset-path", default=None,
                      help="the sharegpt JSON or custom JSONL file")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="output tokens per request (default: the answer's length)")
    data.add_argument("--custom-output-len", type=int, default=256,
                      help="output tokens per request of the custom dataset")
    data.add_argument("--skip-chat-template", action="store_true",
                      help="custom dataset: send the prompts without the chat template")
    data.add_argument("--no-oversample", action="store_true",
                      help="do not repeat requests when the file has fewer than --num-prompts")
    data.add_argument("--disable-shuffle", action="store_true",
                      help="take the file's entries in order")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--input-len", type=int, default=None,
                      help="alias of --random-input-len")
    data.add_argument("--output-len", type=int, default=None,
                      help="alias of --random-output-len")
    data.add_argument("--random-range-ratio", type=parse_range_ratio, default=0.0,
                      help='length range ratio in [0, 1): a float or {"input": a, "output": b}')
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="tokens of a random prefix shared by every prompt")
    data.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-")

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests per second (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival intervals (1: Poisson)")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--ramp-up-strategy", default=None, choices=["linear", "exponential"])
    load.add_argument("--ramp-up-start-rps", type=int, default=None)
    load.add_argument("--ramp-up-end-rps", type=int, default=None)
    load.add_argument("--num-warmups", type=int, default=0)
    load.add_argument("--disable-tqdm", action="store_true")

    sampling = parser.add_argument_group("sampling (sent only when given)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="always on for the random dataset")
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--frequency-penalty", type=float, default=None)
    sampling.add_argument("--presence-penalty", type=float, default=None)
    sampling.add_argument("--repetition-penalty", type=float, default=None)
    sampling.add_argument("--logprobs", type=int, default=None)
    sampling.add_argument("--extra-body", type=json_object, default=None,
                          help="JSON object merged into every request body")

    out = parser.add_argument_group("reporting")
    out.add_argument("--percentile-metrics", default=None,
                     help=f"comma list of {','.join(PERCENTILE_METRICS)} "
                          f"(default {DEFAULT_PERCENTILE_METRICS})")
    out.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 50,90,99")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    out.add_argument("--save-result", action="store_true")
    out.add_argument("--save-detailed", action="store_true",
                     help="keep the per-request lists in the JSON")
    out.add_argument("--append-result", action="store_true")
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename", default=None)
    out.add_argument("--label", default=None, help="result label (default: --backend)")
    out.add_argument("--metadata", metavar="KEY=VALUE", nargs="*",
                     help="extra top-level keys for the result JSON")
    out.add_argument("--plot", action="store_true",
                     help="write a PNG of the TTFT/TPOT/ITL distributions beside the JSON")


def parse_key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    """``["k=v", ...]`` -> ``{"k": "v"}`` (split at the first "=", both sides stripped)."""
    pairs = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"invalid {flag} {item!r}: use KEY=VALUE")
        key, value = item.split("=", 1)
        pairs[key.strip()] = value.strip()
    return pairs


def load_tokenizer(tokenizer_id: str, trust_remote_code: bool = False) -> Any:
    """A Hugging Face tokenizer from a local directory (or the local HF cache); no hub access."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        tokenizer_id, trust_remote_code=trust_remote_code, local_files_only=True
    )


def sample_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """The requests of ``--dataset-name`` (ValueError for a path given to, or missing from,
    the dataset that needs one)."""
    common = dict(num_requests=args.num_prompts, seed=args.seed,
                  request_id_prefix=args.request_id_prefix)
    if args.dataset_name == "random":
        if args.dataset_path is not None:
            raise ValueError("the random dataset takes no --dataset-path; name the file's "
                             "dataset with --dataset-name sharegpt or custom")
        input_len = args.input_len if args.input_len is not None else args.random_input_len
        output_len = args.output_len if args.output_len is not None else args.random_output_len
        return sample_random_requests(
            tokenizer, input_len=input_len, output_len=output_len,
            range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len, **common)
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    files = dict(shuffle=not args.disable_shuffle, fill=not args.no_oversample, **common)
    if args.dataset_name == "sharegpt":
        return sample_sharegpt_requests(tokenizer, args.dataset_path,
                                        output_len=args.sharegpt_output_len, **files)
    return sample_custom_requests(tokenizer, args.dataset_path, output_len=args.custom_output_len,
                                  chat_template=not args.skip_chat_template, **files)


def _redacted(args: argparse.Namespace) -> argparse.Namespace:
    shown = argparse.Namespace(**vars(args))
    if getattr(shown, "header", None):
        shown.header = ["<redacted>"]
    return shown


async def run_benchmark(args: argparse.Namespace, tokenizer: Any | None = None) -> dict[str, Any]:
    """Run ``mlaserve bench serve`` in the current event loop; return the result JSON dict
    (the per-request lists only with --save-detailed). ``tokenizer`` skips loading one."""
    print(_redacted(args))
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be greater than 0")
    ramp_up = None
    if args.ramp_up_strategy is not None:
        if args.request_rate != float("inf"):
            raise ValueError("with --ramp-up-strategy, leave --request-rate unset")
        if args.ramp_up_start_rps is None or args.ramp_up_end_rps is None:
            raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
        if not 0 <= args.ramp_up_start_rps <= args.ramp_up_end_rps:
            raise ValueError("ramp-up RPS must satisfy 0 <= start <= end")
        if args.ramp_up_strategy == "exponential" and args.ramp_up_start_rps == 0:
            raise ValueError("exponential ramp-up cannot start at 0 RPS")
        ramp_up = (args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps)
    random.seed(args.seed)
    np.random.seed(args.seed)

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    api_url = f"{base_url}{args.endpoint}"
    suffix = client.BACKENDS[args.backend][1]
    if not api_url.endswith(suffix):
        raise ValueError(f"--backend {args.backend} needs an API URL ending in {suffix!r}")
    headers = parse_key_values(args.header, "--header") or None
    goodput = report.parse_goodput(args.goodput)
    percentile_metrics = (args.percentile_metrics or DEFAULT_PERCENTILE_METRICS).split(",")
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))

    if args.model is None:
        print("Model not specified, fetching first model from server...")
        model_name, model_id = await client.fetch_first_model(base_url, headers)
        print(f"First model name: {model_name}, first model id: {model_id}")
    else:
        model_name, model_id = args.served_model_name, args.model
    tokenizer_id = args.tokenizer if args.tokenizer is not None else model_id
    if tokenizer is None:
        tokenizer = load_tokenizer(tokenizer_id, args.trust_remote_code)

    requests = sample_requests(args, tokenizer)
    if args.dataset_name == "random":  # drawn as token ids: check them against the server's
        requests = await client.align_prompts_to_server(base_url, model_id, requests)

    sampling = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    if "temperature" not in sampling:
        print("WARNING: mlaserve bench serve does not set temperature==0 (greedy) in requests "
              "by default; the server's default applies. For greedy decoding pass "
              "--temperature=0.")
    config = BenchmarkConfig(
        backend=args.backend, api_url=api_url, base_url=base_url, model_id=model_id,
        model_name=model_name, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ramp_up=ramp_up,
        # the random dataset always ignores EOS on OpenAI-compatible backends; others as asked
        ignore_eos=args.dataset_name == "random" or args.ignore_eos,
        logprobs=args.logprobs, extra_headers=headers,
        extra_body={**sampling, **(args.extra_body or {})},
        percentile_metrics=tuple(percentile_metrics), percentiles=percentiles,
        goodput_slos_ms=goodput, num_warmups=args.num_warmups,
        ready_check_timeout_s=args.ready_check_timeout_sec, disable_tqdm=args.disable_tqdm,
    )
    gc.collect()
    gc.freeze()  # the dataset and tokenizer live all run: keep collector pauses short
    bench_result, metrics = await benchmark(config, requests, tokenizer)
    return finish_result(args, bench_result, metrics, model_id, tokenizer_id, ramp_up)


def finish_result(
    args: argparse.Namespace,
    bench_result: dict[str, Any],
    metrics: report.BenchmarkMetrics,
    model_id: str,
    tokenizer_id: str | None,
    ramp_up: tuple[str, int, int] | None,
) -> dict[str, Any]:
    """Prepend the run settings, write the plot and the JSON file as requested."""
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    result: dict[str, Any] = {
        "date": date,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
    }
    result.update(parse_key_values(args.metadata, "--metadata"))
    result["request_rate"] = args.request_rate if args.request_rate < float("inf") else "inf"
    result["burstiness"] = args.burstiness
    result["max_concurrency"] = args.max_concurrency
    if ramp_up is not None:
        result["ramp_up_strategy"], result["ramp_up_start_rps"], result["ramp_up_end_rps"] = ramp_up
    result.update(bench_result)

    file_name = None
    if args.save_result or args.append_result or args.plot:
        file_name = report.result_filename(
            label=args.label, backend=args.backend, request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, model_id=model_id, date=date, ramp_up=ramp_up,
        )
        if args.result_filename:
            file_name = args.result_filename
        if args.result_dir:
            Path(args.result_dir).mkdir(parents=True, exist_ok=True)
            file_name = str(Path(args.result_dir) / file_name)
    if args.plot and file_name is not None:
        plot_path = str(Path(file_name).with_suffix(".png"))
        try:
            report.save_distribution_plot(plot_path, metrics.ttfts, metrics.tpots, metrics.itls)
            print(f"Saved distribution plot to {plot_path}")
        except Exception:
            print(f"WARNING: could not write the plot:\n{traceback.format_exc()}")
    if not args.save_detailed:
        for key in DETAILED_FIELDS:
            result.pop(key, None)
    if file_name is not None and (args.save_result or args.append_result):
        with open(file_name, "a+" if args.append_result else "w", encoding="utf-8") as f:
            if args.append_result and f.tell() != 0:
                f.write("\n")
            json.dump(result, f)
    return result


def run(args: argparse.Namespace) -> int:
    """CLI entry point: 0 when at least one request succeeded, 1 when none did or the server or
    tokenizer could not be reached. Invalid arguments raise ValueError (the CLI's exit code 2)."""
    try:
        result = asyncio.run(run_benchmark(args))
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}")
        return 1
    return 0 if result["completed"] > 0 else 1
