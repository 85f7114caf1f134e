"""`mlaserve bench sweep`: `bench serve` over several concurrencies (or request rates) against
one or more servers; one JSON of the points and a PNG of the throughput-latency front.

Usage:
  mlaserve bench sweep --run triton=http://127.0.0.1:8000 \\
      --run flashinfer=http://127.0.0.1:8001 --max-concurrency-list 1,16,64,256 \\
      --random-input-len 1024 --random-output-len 1024 \\
      --num-prompts-per-concurrency 4 --min-num-prompts 32 --ignore-eos \\
      --result-file sweep.json --plot-file sweep.png --title "V2-Lite, 1 H100"
  mlaserve bench sweep --replot a.json [b.json ...] --plot-file front.png   # no server needed

Every `--run LABEL=BASE_URL` is swept in turn, point by point, each point a full `bench serve`
run in this process (the other `bench serve` flags below pass through unchanged). A point keeps
its concurrency or rate, completed, output_throughput and its value per GPU (--num-gpus),
tok/s per user (1000 / median TPOT, and from the mean TPOT), TTFT and TPOT median and p99,
request_throughput, and more. The JSON is rewritten after every point, so a sweep that stops
keeps what it measured. The chart: x = tok/s per user, y = output tok/s per GPU, one line per
run label, each point marked with its concurrency (c16) or rate (4 rps). --replot draws it from
result JSONs, merging their runs into one chart. The chart needs matplotlib
(pip install 'mlaserve[plot]'); --no-plot skips it.
"""

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from mlaserve.arg_types import positive_float_list, positive_int, positive_int_list
from mlaserve.bench import serve
from mlaserve.bench import serve_client as client

# `bench serve` flags that the sweep sets per point, or that write files it does not want
PER_POINT = frozenset({
    "base_url", "host", "port", "max_concurrency", "request_rate", "num_prompts", "label",
    "save_result", "save_detailed", "append_result", "result_dir", "result_filename",
    "metadata", "plot", "percentile_metrics", "metric_percentiles",
})
# each point's `bench serve` reports these sections and percentiles
PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
METRIC_PERCENTILES = "50,90,99"
# `bench serve` result keys kept for each point
POINT_KEYS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
)
DEFAULT_NUM_PROMPTS = 1000
PLOT_INSTALL = "pip install 'mlaserve[plot]'"


def run_spec(text: str) -> tuple[str, str]:
    """'triton=http://127.0.0.1:8000' -> ('triton', 'http://127.0.0.1:8000')."""
    label, sep, url = text.partition("=")
    label, url = label.strip(), url.strip().rstrip("/")
    if not sep or not label or not url:
        raise argparse.ArgumentTypeError(
            f"expected LABEL=BASE_URL (e.g. triton=http://127.0.0.1:8000), got {text!r}")
    return label, url


class _ServeFlags:
    """Stands in for the parser in `serve.add_arguments`: the groups it asks for are groups of
    the sweep's parser that take every flag except those in PER_POINT."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def add_argument_group(self, title: str) -> "_ServeFlags":
        return _ServeFlags(self._target.add_argument_group(f"bench serve: {title}"))

    def add_argument(self, *flags: str, **kwargs: Any) -> None:
        dest = kwargs.get("dest") or flags[0].lstrip("-").replace("-", "_")
        if dest not in PER_POINT:
            self._target.add_argument(*flags, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench sweep` flags, then those of `bench serve` that pass through."""
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--run", action="append", type=run_spec, default=[],
                       metavar="LABEL=BASE_URL", help="a server to sweep (repeat for several)")
    points = sweep.add_mutually_exclusive_group()
    points.add_argument("--max-concurrency-list", type=positive_int_list, default=None,
                        metavar="C,C,...", help="one point per max concurrency (rate: inf)")
    points.add_argument("--request-rate-list", type=positive_float_list, default=None,
                        metavar="R,R,...",
                        help="one point per request rate (req/s, inf allowed; no concurrency "
                             "limit)")
    sweep.add_argument("--num-prompts", type=positive_int, default=None,
                       help=f"prompts per point (default {DEFAULT_NUM_PROMPTS}, unless "
                            "--num-prompts-per-concurrency)")
    sweep.add_argument("--num-prompts-per-concurrency", type=positive_int, default=None,
                       metavar="K", help="K x concurrency prompts per point, at least "
                                         "--min-num-prompts (with --max-concurrency-list)")
    sweep.add_argument("--min-num-prompts", type=positive_int, default=1)
    sweep.add_argument("--num-gpus", type=positive_int, default=None,
                       help="GPUs behind each server, for output tok/s per GPU (default 1; with "
                            "--replot: recompute it for every point)")
    sweep.add_argument("--result-file", default=None,
                       help="the sweep's JSON (default sweep-DATE.json)")
    sweep.add_argument("--plot-file", default=None,
                       help="the chart's PNG (default: the (first) JSON's name with .png)")
    sweep.add_argument("--no-plot", action="store_true", help="write the JSON only")
    sweep.add_argument("--title", default=None,
                       help="chart title (default: model and workload; with --replot the "
                            "first file's)")
    sweep.add_argument("--replot", nargs="+", default=None, metavar="RESULT.json",
                       help="draw the chart from these sweep JSONs (runs merged) and run nothing")
    serve.add_arguments(_ServeFlags(parser))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Point:
    """One `bench serve` run of a sweep."""

    max_concurrency: int | None
    request_rate: float
    num_prompts: int

    @property
    def name(self) -> str:
        return point_name(self.max_concurrency, self.request_rate)


def point_name(max_concurrency: int | None, request_rate: float | str) -> str:
    """'c16' for a concurrency point, '4 rps' (or 'inf rps') for a rate point."""
    if max_concurrency is not None:
        return f"c{max_concurrency}"
    return f"{float(request_rate):g} rps"


def sweep_points(args: argparse.Namespace) -> list[Point]:
    """The points of --max-concurrency-list or --request-rate-list, with their prompt counts."""
    if args.num_prompts is not None and args.num_prompts_per_concurrency is not None:
        raise ValueError("give --num-prompts or --num-prompts-per-concurrency, not both")
    fixed = args.num_prompts or DEFAULT_NUM_PROMPTS
    if args.max_concurrency_list is not None:
        per = args.num_prompts_per_concurrency
        return [Point(c, float("inf"), fixed if per is None else max(per * c, args.min_num_prompts))
                for c in args.max_concurrency_list]
    if args.request_rate_list is None:
        raise ValueError("a sweep needs --max-concurrency-list or --request-rate-list")
    if args.num_prompts_per_concurrency is not None:
        raise ValueError("--num-prompts-per-concurrency needs --max-concurrency-list; give "
                         "--num-prompts for a rate sweep")
    return [Point(None, rate, fixed) for rate in args.request_rate_list]


def serve_namespace(args: argparse.Namespace, label: str, base_url: str,
                    point: Point) -> argparse.Namespace:
    """The `bench serve` arguments of one point: the passed-through flags, the point's own."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    ns = parser.parse_args([])
    for key in vars(ns):
        if key not in PER_POINT:
            setattr(ns, key, getattr(args, key))
    ns.base_url, ns.label = base_url, f"{label}-{point.name.replace(' ', '')}"
    ns.max_concurrency, ns.request_rate = point.max_concurrency, point.request_rate
    ns.num_prompts = point.num_prompts
    ns.percentile_metrics, ns.metric_percentiles = PERCENTILE_METRICS, METRIC_PERCENTILES
    ns.request_id_prefix = f"{args.request_id_prefix}{ns.label}-"
    return ns


def _rate_value(rate: float) -> float | str:
    return "inf" if rate == float("inf") else rate


def _jsonable(value: Any) -> Any:
    """``value`` with every infinite float as "inf" (JSON has no infinity)."""
    if isinstance(value, float):
        return _rate_value(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def point_record(point: Point, result: dict[str, Any], num_gpus: int) -> dict[str, Any]:
    """One point of the JSON: its settings, the kept `bench serve` keys and the derived ones."""
    record: dict[str, Any] = {"max_concurrency": point.max_concurrency,
                              "request_rate": _rate_value(point.request_rate),
                              "num_prompts": point.num_prompts}
    record.update({key: result.get(key) for key in POINT_KEYS})
    record["output_throughput_per_gpu"] = result["output_throughput"] / num_gpus
    for stat in ("median", "mean"):
        tpot = result.get(f"{stat}_tpot_ms")
        prefix = "" if stat == "median" else "mean_"
        record[f"{prefix}tok_s_per_user"] = 1000 / tpot if tpot else None
    return record


async def _tokenizer_id(args: argparse.Namespace, base_url: str) -> str:
    """The tokenizer `bench serve` would load for this server (--tokenizer, --model, else the
    model root that /v1/models names)."""
    if args.tokenizer is not None or args.model is not None:
        return args.tokenizer or args.model
    headers = serve.parse_key_values(args.header, "--header") or None
    return (await client.fetch_first_model(base_url, headers))[1]


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the sweep ran with, for the JSON (headers redacted, inf as "inf")."""
    skipped = {"command", "bench_command", "handler", "module", "run", "replot", "log_level",
               "header"}
    return {key: _jsonable(value) for key, value in vars(args).items() if key not in skipped}


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write the sweep's JSON (parent folders made)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")


def new_result(args: argparse.Namespace, points: list[Point]) -> dict[str, Any]:
    """The sweep's JSON before its first point: settings, and no runs yet."""
    return {"date": datetime.now().isoformat(timespec="seconds"), "title": args.title,
            "num_gpus": args.num_gpus or 1,
            "sweep": "request_rate" if points[0].max_concurrency is None else "max_concurrency",
            "settings": _settings(args), "runs": {}}


async def run_sweep(args: argparse.Namespace, points: list[Point], doc: dict[str, Any],
                    result_file: str) -> None:
    """Run every point against every server in turn into ``doc`` (new_result); rewrite the
    JSON after each point."""
    num_gpus = doc["num_gpus"]
    tokenizers: dict[str, Any] = {}
    for label, base_url in args.run:
        tokenizer_id = await _tokenizer_id(args, base_url)
        if tokenizer_id not in tokenizers:
            tokenizers[tokenizer_id] = serve.load_tokenizer(tokenizer_id, args.trust_remote_code)
        run: dict[str, Any] = {"base_url": base_url, "sweep": doc["sweep"], "points": []}
        doc["runs"][label] = run
        for point in points:
            print(f"== bench sweep: {label} at {point.name}, {point.num_prompts} prompts")
            result = await serve.run_benchmark(serve_namespace(args, label, base_url, point),
                                               tokenizers[tokenizer_id])
            run["model_id"] = result["model_id"]
            run["points"].append(point_record(point, result, num_gpus))
            write_json(result_file, doc)
    if doc["title"] is None:
        doc["title"] = default_title(args, next(iter(doc["runs"].values()))["model_id"])
        write_json(result_file, doc)


def default_title(args: argparse.Namespace, model_id: str) -> str:
    """'<model>: random 1024 in / 1024 out' (the dataset's name alone for the others)."""
    model = Path(model_id).name or model_id
    if args.dataset_name != "random":
        return f"{model}: {args.dataset_name}"
    input_len = args.input_len if args.input_len is not None else args.random_input_len
    output_len = args.output_len if args.output_len is not None else args.random_output_len
    return f"{model}: random {input_len} in / {output_len} out"


def merge_results(paths: list[str], num_gpus: int | None = None
                  ) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The runs of several sweep JSONs (a label seen before gets its file's name in front) and
    the first file's title; with `num_gpus`, every point's per-GPU throughput recomputed."""
    runs: dict[str, dict[str, Any]] = {}
    title = None
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the sweep result {path}: {exc}") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("runs"), dict):
            raise ValueError(f"{path} is not a bench sweep result (no 'runs' object)")
        title = title if title is not None else doc.get("title")
        for label, run in doc["runs"].items():
            name = label if label not in runs else f"{Path(path).stem}:{label}"
            runs[name] = run
            if num_gpus is not None:
                for p in run["points"]:
                    p["output_throughput_per_gpu"] = p["output_throughput"] / num_gpus
    return runs, title


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _figure() -> Any:
    """A matplotlib Figure on an Agg canvas (no pyplot, no global backend change)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailable(f"the chart needs matplotlib: {PLOT_INSTALL} (or pass "
                              "--no-plot)") from exc
    fig = Figure(figsize=(9, 6))
    FigureCanvasAgg(fig)
    return fig


def plot_front(runs: dict[str, dict[str, Any]], path: str, title: str | None) -> None:
    """The throughput-latency front: x = tok/s per user, y = output tok/s per GPU; one line
    with markers per run, each point marked with its concurrency or rate."""
    fig = _figure()
    ax = fig.add_subplot()
    for label, run in runs.items():
        points = [p for p in run["points"]
                  if p.get("tok_s_per_user") and p.get("output_throughput_per_gpu") is not None]
        xs = [p["tok_s_per_user"] for p in points]
        ys = [p["output_throughput_per_gpu"] for p in points]
        (line,) = ax.plot(xs, ys, marker="o", label=label)
        for p, x, y in zip(points, xs, ys, strict=True):
            ax.annotate(point_name(p.get("max_concurrency"), p.get("request_rate", "inf")),
                        (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8,
                        color=line.get_color())
    ax.set_xlabel("tok/s per user (1000 / median TPOT)")
    ax.set_ylabel("output tok/s per GPU")
    ax.margins(0.08)  # room for the point labels
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _replot(args: argparse.Namespace) -> int:
    if args.run or args.max_concurrency_list or args.request_rate_list:
        raise ValueError("--replot draws saved results: give no --run or point list with it")
    runs, title = merge_results(args.replot, args.num_gpus)
    plot_file = args.plot_file or str(Path(args.replot[0]).with_suffix(".png"))
    plot_front(runs, plot_file, args.title or title)
    print(f"bench sweep: wrote {plot_file} ({len(runs)} runs)")
    return 0


def run(args: argparse.Namespace) -> int:
    """CLI entry point: 0 when every point completed a request, 1 when one completed none or a
    server could not be reached, 2 when matplotlib is missing for the chart. Invalid arguments
    raise ValueError (the CLI's exit code 2)."""
    try:
        return _replot(args) if args.replot is not None else _sweep(args)
    except PlotUnavailable as exc:
        print(f"mlaserve: error: {exc}", file=sys.stderr)
        return 2


def _sweep(args: argparse.Namespace) -> int:
    if not args.run:
        raise ValueError("a sweep needs at least one --run LABEL=BASE_URL (or --replot)")
    labels = [label for label, _ in args.run]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--run labels must differ, got {labels}")
    points = sweep_points(args)
    if not args.no_plot:
        _figure()  # fail before the sweep, not after it
    result_file = args.result_file or f"sweep-{datetime.now():%Y%m%d-%H%M%S}.json"
    doc = new_result(args, points)
    try:
        asyncio.run(run_sweep(args, points, doc, result_file))
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}")
        if any(run["points"] for run in doc["runs"].values()):
            print(f"bench sweep: the points measured so far are in {result_file} (--replot "
                  "draws them)")
        return 1
    print(f"bench sweep: wrote {result_file}")
    if not args.no_plot:
        plot_file = args.plot_file or str(Path(result_file).with_suffix(".png"))
        plot_front(doc["runs"], plot_file, doc["title"])
        print(f"bench sweep: wrote {plot_file}")
    completed = [p["completed"] for r in doc["runs"].values() for p in r["points"]]
    return 0 if all(completed) else 1
