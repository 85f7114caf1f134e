"""Where a decode step's time goes: host phases, the model forward, and a torch.profiler table.

Usage (GPU): python3 scripts/gpu_profile_decode.py MODEL_DIR [--backend triton] [--batch 256]
    [--prompt-len 1024] [--steps 32] [--out DIR] [--enforce-eager]
Builds the engine with dummy weights, prefills `batch` random prompts, then times decode steps
with the device synchronised at each phase boundary ("forward" is the graph replay when decode
CUDA graphs were captured), and writes a torch.profiler table of four more steps.
"""

import argparse
import random
import time
from pathlib import Path

import torch

from mlaserve.engine.engine import EngineArgs, LLMEngine
from mlaserve.engine.request import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    engine = LLMEngine(EngineArgs(model=args.model, load_format="dummy", block_size=32,
                                  max_num_seqs=args.batch, attention_backend=args.backend,
                                  enforce_eager=args.enforce_eager))
    print(f"engine built in {time.perf_counter() - started:.1f} s")
    rng = random.Random(0)
    vocab = len(engine.tokenizer)
    for _ in range(args.batch):
        ids = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        engine.add_request(ids, SamplingParams(max_tokens=args.steps * 4 + 16, temperature=0,
                                               ignore_eos=True))
    started = time.perf_counter()
    steps = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    print(f"prefill: {steps} steps in {time.perf_counter() - started:.2f} s")
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()

    runner = engine.runner
    # the decode forward: a graph replay when graphs were captured, else the eager model
    owner = runner.graphs if runner.graphs is not None else runner.model
    attribute = "run" if runner.graphs is not None else "forward"
    execute, model_forward = runner.execute, getattr(owner, attribute)
    phases: dict[str, float] = {"forward": 0.0, "execute": 0.0}

    def timed_forward(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model_forward(*a, **k)
        torch.cuda.synchronize()
        phases["forward"] += time.perf_counter() - t
        return out

    def timed_execute(batch):
        t = time.perf_counter()
        out = execute(batch)
        phases["execute"] += time.perf_counter() - t
        return out

    setattr(owner, attribute, timed_forward)
    runner.execute = timed_execute
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = time.perf_counter() - started
    n = args.steps
    print(f"decode step (batch {args.batch}, synced phases): {total / n * 1e3:.1f} ms; "
          f"execute {phases['execute'] / n * 1e3:.1f} ms, forward {phases['forward'] / n * 1e3:.1f}"
          f" ms, engine bookkeeping {(total - phases['execute']) / n * 1e3:.1f} ms")
    setattr(owner, attribute, model_forward)
    runner.execute = execute

    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    print(f"decode step unsynced: {(time.perf_counter() - started) / n * 1e3:.1f} ms")

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
    table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    table_gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
    print(table_cpu)
    print(table_gpu)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile-{args.backend}.txt").write_text(table_cpu + "\n" + table_gpu)


if __name__ == "__main__":
    main()
