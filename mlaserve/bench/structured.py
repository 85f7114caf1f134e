"""`mlaserve bench structured`: the per-step cost of structured outputs, decode throughput with
and without a JSON schema.

Usage: mlaserve bench structured [--concurrency 64] [--output-len 128] [--runs 3]
    [--device cpu]

The built-in demo model (random weights). `concurrency` requests with short prompts are added at
once; after every request has its first token (prefill done), the decode steps are timed until
all finish, and output tokens per second are printed, for free text and for a JSON schema whose
output is longer than `output-len` tokens (an array of at least 100 small objects, compact
JSON), so constrained requests also run to `output-len`. Runs alternate between the two.
Also printed: the host time per step spent filling grammar bitmasks.
"""

import argparse
import json
import random
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array", "minItems": 100,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "kind", "ok"],
            },
        },
    },
    "required": ["items"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench structured` flags."""
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu")


def timed_batch(llm, prompts: list[list[int]], params: list) -> tuple[float, float]:
    """(decode output tok/s, bitmask fill ms per decode step) for one batch of requests."""
    engine = llm.engine
    manager = engine.core.structured
    fill = manager.grammar_bitmask
    fill_seconds = [0.0]

    def timed_fill(requests):
        started = time.perf_counter()
        try:
            return fill(requests)
        finally:
            fill_seconds[0] += time.perf_counter() - started

    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=f"bench-{i}")
    started_tokens: dict[str, int] = {}
    while len(started_tokens) < len(prompts):  # prefill, until every request has a token
        for out in engine.step():
            started_tokens.setdefault(out.request_id, len(out.token_ids))
    manager.grammar_bitmask = timed_fill
    steps, generated = 0, 0
    started = time.perf_counter()
    try:
        while engine.has_unfinished:
            outputs = engine.step()
            steps += 1
            generated += sum(1 for o in outputs if o.token_ids)
    finally:
        manager.grammar_bitmask = fill
    seconds = time.perf_counter() - started
    return generated / seconds, 1000 * fill_seconds[0] / max(steps, 1)


def run(args: argparse.Namespace) -> int:
    """Warm up both cases, time `runs` rounds of each, print the medians and their ratio."""
    from mlaserve import LLM, SamplingParams
    from mlaserve.engine.request import StructuredOutputs

    llm = LLM(device=args.device, max_num_seqs=max(args.concurrency, 1),
              num_kv_blocks=args.concurrency * (args.output_len + 64) // 16 + 16, block_size=16)
    rng = random.Random(0)
    top_id = min(1000, llm.engine.config.model.vocab_size)
    prompts = [[rng.randrange(4, top_id) for _ in range(16)] for _ in range(args.concurrency)]
    constraint = StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    cases = {
        "free text": lambda s: SamplingParams(max_tokens=args.output_len, seed=s,
                                              ignore_eos=True, output_kind="delta"),
        "json_schema": lambda s: SamplingParams(max_tokens=args.output_len, seed=s,
                                                ignore_eos=True, output_kind="delta",
                                                structured_outputs=constraint),
    }
    # warm-up: compiles the grammar, touches every path once
    for make in cases.values():
        timed_batch(llm, prompts[:2], [make(s) for s in range(2)])
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for r in range(args.runs):
        for name, make in cases.items():
            tok_s, fill_ms = timed_batch(llm, prompts,
                                         [make(1000 * r + s) for s in range(len(prompts))])
            results[name].append((tok_s, fill_ms))
            print(f"run {r + 1} {name:12s}: {tok_s:8.1f} output tok/s (decode), "
                  f"bitmask fill {fill_ms:.2f} ms/step", flush=True)
    print(f"\n{args.concurrency} concurrent requests, {args.output_len} output tokens each, "
          f"device {args.device}")
    for name, values in results.items():
        speeds = [v[0] for v in values]
        print(f"{name:12s}: median {statistics.median(speeds):8.1f} tok/s "
              f"(runs: {', '.join(f'{s:.1f}' for s in speeds)}); bitmask fill "
              f"{statistics.median(v[1] for v in values):.2f} ms/step")
    free = statistics.median(v[0] for v in results["free text"])
    constrained = statistics.median(v[0] for v in results["json_schema"])
    print(f"json_schema / free text: {constrained / free:.3f}")
    return 0
