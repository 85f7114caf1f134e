"""`mlaserve bench step`: where a decode step's time goes.

Usage (GPU): mlaserve bench step MODEL_DIR [--backend triton] [--batch 256] [--prompt-len 1024]
    [--steps 32] [--block-size 32] [--out DIR] [--enforce-eager] [--quantization fp8]
    [--kv-cache-dtype fp8]
Builds the engine core with dummy weights, prefills `batch` random prompts, lets decode settle,
then times `steps` pipelined decode steps (wall clock), and profiles as many more with
torch.profiler: the kernels' summed device time per step (the GPU's busy time: one stream, so
kernels never overlap) against the wall time per step, and that busy time split by kernel name
into attention, MoE, dense GEMMs, norms/rope, sampling and the rest (`step_gpu.py`); then the
prefill of a second wave of prompts, its GPU time by kind. Writes the table and the profiler's
kernel list to --out (profile-BACKEND-bBATCH.txt).

Usage (CPU): mlaserve bench step --host-only [MODEL_DIR] [--batch 256] [--prompt-len 1024]
    [--steps 50] [--speculative-config JSON]
The engine's host-side cost per decode step, with the model forward replaced by a stub (default
model: the built-in demo model, torch backend): scheduling, tensor building, sampling,
detokenisation and output bookkeeping, without the model's compute. After prefill and 5 x
`steps` steps (outputs grow, as in a long generation) it prints ms per step and per emitted
token over `steps` steps under cProfile, and the top functions. With --speculative-config the
MTP module is a stub too: its drafts are the token the zero logits sample, so every draft is
accepted and each step emits k + 1 tokens a request (the bookkeeping of full acceptance).
With --count-kernels it counts instead, over `steps` steps, the operations a GPU step launches
one by one: the engine runs with CPU stand-ins of the decode and drafting CUDA graphs
(`engine/graph_standins.py`), whose replays count as one launch each; views and conversions
to the same dtype launch nothing, host-device copies count.
"""

import argparse

from mlaserve.arg_types import json_object


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench step` flags."""
    parser.add_argument("model", nargs="?", default=None,
                        help="HF model directory, dummy weights (with --host-only default: the "
                             "built-in demo model)")
    parser.add_argument("--host-only", action="store_true",
                        help="the host's cost per step on the CPU, the model forward a stub")
    parser.add_argument("--count-kernels", action="store_true",
                        help="with --host-only: the operations a step launches outside its "
                             "CUDA graphs, per step, instead of the times")
    parser.add_argument("--backend", default=None,
                        help="attention backend (default: triton; torch with --host-only)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps timed and profiled (default: 32; 50 with --host-only)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--out", default=None, help="directory for the report (GPU profile)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="decode without CUDA graphs (GPU profile)")
    parser.add_argument("--quantization", default="auto",
                        help="as `mlaserve serve --quantization` (GPU profile; fp8: block-FP8 "
                             "Linear weights and experts)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="as `mlaserve serve --kv-cache-dtype` (GPU profile)")
    parser.add_argument("--speculative-config", type=json_object, default=None,
                        help="as `mlaserve serve --speculative-config`: a step verifies and "
                             "drafts; the report adds the tokens a step emits")


def run(args: argparse.Namespace) -> int:
    """The host-only stub run, or the GPU profile."""
    if args.host_only:
        host_step(args.model, args.backend or "torch", args.batch, args.prompt_len,
                  args.steps or 50, args.block_size, args.speculative_config,
                  args.count_kernels)
        return 0
    if args.model is None:
        raise ValueError("mlaserve bench step profiles a model directory on the GPU: give "
                         "MODEL_DIR, or --host-only for the host's cost on the CPU")
    from mlaserve.bench.step_gpu import profile_steps

    profile_steps(args.model, args.backend or "triton", args.batch, args.prompt_len,
                  args.steps or 32, args.block_size, args.out, args.enforce_eager,
                  args.quantization, args.kv_cache_dtype, args.speculative_config)
    return 0


def host_step(model: str | None, backend: str, batch: int, prompt_len: int, steps: int,
              block_size: int, speculative_config: dict | None = None,
              count_kernels: bool = False) -> None:
    """Print host ms per decode step and per emitted token at `batch` with the model forward
    (and the MTP module's) stubbed out, and the top functions by their own time; or, with
    count_kernels, the launches per step outside the graphs (their stand-ins)."""
    import cProfile
    import pstats
    import random
    import time

    import torch

    from mlaserve.engine.engine import EngineArgs, LLMEngine
    from mlaserve.engine.request import SamplingParams

    engine = LLMEngine(EngineArgs(model=model, attention_backend=backend, device="cpu",
                                  block_size=block_size, max_num_seqs=batch,
                                  num_kv_blocks=batch * (prompt_len // block_size + 80),
                                  speculative_config=speculative_config))
    per_step = 1 + (engine.config.speculative.num_speculative_tokens
                    if engine.config.speculative is not None else 0)  # tokens a request a step
    warm_steps = max(1, 5 * steps // per_step)
    hidden_size = engine.config.model.hidden_size
    engine.runner.model.forward = lambda ids, *_: torch.zeros(ids.shape[0], hidden_size)
    if engine.runner.model.mtp is not None and speculative_config is not None:
        engine.runner.model.mtp.forward = lambda ids, *_: torch.zeros(ids.shape[0], hidden_size)
    if count_kernels:
        from mlaserve.engine import graph_standins

        graph_standins.install(engine.runner, batch, prompt_len // block_size + 80)
    rng = random.Random(0)
    top_id = min(1000, engine.config.model.vocab_size)
    for _ in range(batch):
        prompt = [rng.randrange(5, top_id) for _ in range(prompt_len)]
        engine.add_request(prompt, SamplingParams(max_tokens=(warm_steps + steps) * per_step
                                                  + 300, ignore_eos=True, temperature=0))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    for _ in range(warm_steps):  # let outputs grow, as in a long generation
        engine.step()
    emitted_before = sum(len(r.output_token_ids) for r in engine.requests.values())
    if count_kernels:
        from mlaserve.bench.step_kernels import count_launches

        launches = count_launches(engine.step, steps)
        emitted = sum(len(r.output_token_ids) for r in engine.requests.values()) - emitted_before
        print(f"launches per decode step at batch {batch} outside the CUDA graphs: "
              f"{launches.total() / steps:.1f} ({emitted / steps / batch:.2f} tokens a request "
              f"a step; graph replays: {launches['graph replay'] / steps:.1f}); by operation:")
        for name, count in launches.most_common(15):
            print(f"  {count / steps:6.1f}  {name}")
        return
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    seconds = time.perf_counter() - started
    emitted = sum(len(r.output_token_ids) for r in engine.requests.values()) - emitted_before
    print(f"host ms per decode step at batch {batch}: {seconds / steps * 1e3:.2f} "
          f"({emitted / steps / batch:.2f} tokens a request a step; host ms per token of one "
          f"request: {seconds / (emitted / batch) * 1e3:.3f})")
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
