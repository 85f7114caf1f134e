"""`mlaserve eval --tasks arith_gen,arith_mc,arith_chat`: held-out task scores, task x engine.

Each column is one engine: mlaserve in process with one attention backend (`--attention-backend
torch,triton` gives two columns), transformers (`--engine transformers`), or a server
(`--base-url`). Columns after the first are compared with it question by question; the JSON
output holds every question's score and prediction. With `--speculative-config`, a line per
task and engine after the table gives the speculative-decoding counters of that task's
requests (`spec_line`; also under "spec_decode" in the JSON).
"""

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace

from mlaserve.engine.speculative import SpecDecodeStats
from mlaserve.eval import tasks as T
from mlaserve.eval.engines import EvalEngine

METRICS = {"arith_gen": "exact_match", "arith_chat": "exact_match", "arith_mc": "acc"}


@dataclass
class TaskResult:
    """One task through one engine: the score and each question's outcome."""

    task: str
    metric: str
    score: float
    correct: list[int]  # 1 where the question was answered right, in held-out order
    predictions: list[str] = field(default_factory=list)  # generated text, or the chosen letter
    # arith_mc: log p(" A".." D" | prompt) per question (to tell a near tie from a bug)
    choice_logprobs: list[list[float]] = field(default_factory=list)


def run_task(engine: EvalEngine, task: str, limit: int | None = None,
             max_tokens: int = T.MAX_GEN_TOKS, stop: list[str] | None = None) -> TaskResult:
    """Score the first `limit` held-out questions of `task` with `engine`."""
    docs, shots = T.heldout_docs(task, limit), T.fewshot_docs(task)
    stop = T.UNTIL if stop is None else stop
    if task == "arith_mc":
        pairs = [(T.completion_prompt(task, d, shots), f" {letter}")
                 for d in docs for letter in T.CHOICE_LETTERS]
        scores = engine.loglikelihood(pairs)
        width = len(T.CHOICE_LETTERS)
        chosen = [max(range(width), key=lambda k, i=i: scores[i * width + k])
                  for i in range(len(docs))]
        correct = [int(c == d["answer"]) for c, d in zip(chosen, docs, strict=True)]
        predictions = [T.CHOICE_LETTERS[c] for c in chosen]
        choice_logprobs = [scores[i * width:(i + 1) * width] for i in range(len(docs))]
    else:
        if task == "arith_chat":
            predictions = engine.chat([T.chat_messages(d, shots) for d in docs], stop, max_tokens)
        else:
            predictions = engine.generate([T.completion_prompt(task, d, shots) for d in docs],
                                          stop, max_tokens)
        correct = [int(T.exact_match(p, d)) for p, d in zip(predictions, docs, strict=True)]
        choice_logprobs = []
    return TaskResult(task, METRICS[task], sum(correct) / max(1, len(correct)), correct,
                      predictions, choice_logprobs)


def disagreements(first: TaskResult, other: TaskResult) -> list[int]:
    """Indices of the questions scored differently by two engines."""
    return [i for i, (a, b) in enumerate(zip(first.correct, other.correct, strict=True))
            if a != b]


def format_table(results: dict[str, dict[str, TaskResult]]) -> str:
    """Rows: tasks; columns: engines; a last block counts disagreements with column one."""
    columns = list(results)
    tasks = list(results[columns[0]])
    width = max(14, *(len(c) + 2 for c in columns))
    lines = ["task".ljust(12) + "metric".ljust(13) + "n".rjust(6) + "".join(
        c.rjust(width) for c in columns)]
    for task in tasks:
        first = results[columns[0]][task]
        lines.append(task.ljust(12) + first.metric.ljust(13) + str(len(first.correct)).rjust(6)
                     + "".join(f"{results[c][task].score:.4f}".rjust(width) for c in columns))
    if len(columns) > 1:
        for task in tasks:
            first = results[columns[0]][task]
            counts = [len(disagreements(first, results[c][task])) for c in columns[1:]]
            lines.append(f"{task}: questions scored differently from {columns[0]}: " + ", ".join(
                f"{c} {n}" for c, n in zip(columns[1:], counts, strict=True)))
    return "\n".join(lines)


def spec_delta(before: dict, after: dict) -> dict:
    """The speculative-decoding counters between two `EvalEngine.spec_stats` readings, with
    the mean acceptance length (1 + accepted / drafts, vLLM's; 0 without drafts) and the
    acceptance rate of each draft position (accepted there / drafts)."""
    spec = SpecDecodeStats(**after).since(SpecDecodeStats(**before))
    return {**asdict(spec), "mean_acceptance_length": spec.mean_acceptance_length,
            "acceptance_per_pos": spec.acceptance_per_pos}


def spec_line(label: str, task: str, spec: dict) -> str:
    """One line of a task's speculative-decoding counters."""
    if not spec["num_drafts"]:
        return (f"{task} ({label}): speculative decoding: no drafts verified (no request "
                "decoded past its first token)")
    return (f"{task} ({label}): speculative decoding: {spec['num_drafts']} drafts, "
            f"{spec['num_draft_tokens']} draft tokens, {spec['num_accepted_tokens']} accepted, "
            f"mean acceptance length {spec['mean_acceptance_length']:.3f}, acceptance per "
            "position " + ", ".join(f"{a:.3f}" for a in spec["acceptance_per_pos"]))


def to_json(results: dict[str, dict[str, TaskResult]], meta: dict) -> dict:
    columns = list(results)
    first = results[columns[0]]
    return {**meta, "results": {c: {t: asdict(r) for t, r in by_task.items()}
                                for c, by_task in results.items()},
            "disagreements": {c: {t: disagreements(first[t], r) for t, r in by_task.items()}
                              for c, by_task in list(results.items())[1:]}}


def engines_from(args: argparse.Namespace):
    """Engine factories, one per column, built lazily (one model in memory at a time)."""
    from mlaserve.eval.engines import MlaserveEngine, ServerEngine, TransformersEngine

    if args.base_url:
        return [lambda: ServerEngine(args.base_url, args.served_model_name, args.api_key,
                                     args.num_concurrent)]
    from mlaserve.cli import engine_args_from
    from mlaserve.engine.args import model_dir_of

    base = engine_args_from(args)
    factories = []
    for name in args.engine.split(","):
        if name == "mlaserve":
            for backend in (args.attention_backend or "auto").split(","):
                factories.append(lambda b=backend: MlaserveEngine(
                    replace(base, attention_backend=b)))
        elif name == "transformers":
            factories.append(lambda: TransformersEngine.load(model_dir_of(base), args.device,
                                                        args.dtype, args.batch_size))
        else:
            raise ValueError(f"unknown --engine '{name}'; use mlaserve and/or transformers")
    return factories


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mlaserve.cli import add_engine_arguments

    add_engine_arguments(parser)
    parser.description = (__doc__ or "").split("\n\n")[0] + " (`mlaserve eval parity --help`: " \
        "greedy outputs and logprobs of engine configurations against a reference)"
    parser.add_argument("--tasks", default=",".join(T.TASKS),
                        help=f"comma list of {', '.join(T.TASKS)}")
    parser.add_argument("--engine", default="mlaserve",
                        help="comma list: mlaserve (one column per --attention-backend, which "
                             "takes a comma list here) and/or transformers")
    parser.add_argument("--base-url", default=None,
                        help="score an OpenAI-compatible server (http://HOST:PORT) instead")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name sent to the server (default: its first model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--num-concurrent", type=int, default=8, help="server requests at once")
    parser.add_argument("--batch-size", type=int, default=64, help="transformers batch size")
    parser.add_argument("--limit", type=int, default=None, help="first N held-out questions")
    parser.add_argument("--max-gen-tokens", type=int, default=T.MAX_GEN_TOKS)
    parser.add_argument("--output", default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    names = args.tasks.split(",")
    unknown = sorted(set(names) - set(T.TASKS))
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known: {', '.join(T.TASKS)}")
    results: dict[str, dict[str, TaskResult]] = {}
    spec: dict[str, dict[str, dict]] = {}  # engines that speculate: task -> counters
    for factory in engines_from(args):
        engine = factory()
        try:
            label = engine.label
            while label in results:
                label += "'"
            results[label] = {}
            for task in names:
                print(f"{label}: {task}...", file=sys.stderr, flush=True)
                before = engine.spec_stats()
                results[label][task] = run_task(engine, task, args.limit, args.max_gen_tokens)
                if before is not None:
                    spec.setdefault(label, {})[task] = spec_delta(before, engine.spec_stats())
        finally:
            engine.close()
    print(format_table(results))
    for label, by_task in spec.items():
        for task, counters in by_task.items():
            print(spec_line(label, task, counters))
    if args.output:
        meta = {"model": args.base_url or args.model or "demo_model", "limit": args.limit,
                "tasks": names, **({"spec_decode": spec} if spec else {})}
        with open(args.output, "w") as f:
            json.dump(to_json(results, meta), f, indent=1)
    return 0
