"""Where a decode step's time goes: wall time per step, GPU busy time, and the GPU time by kind.

Usage (GPU): python3 scripts/gpu_profile_decode.py MODEL_DIR [--backend triton] [--batch 256]
    [--prompt-len 1024] [--steps 32] [--out DIR] [--enforce-eager]
Builds the engine core with dummy weights, prefills `batch` random prompts, lets decode settle,
then times `steps` pipelined decode steps (wall clock), and profiles as many more with
torch.profiler: the kernels' summed device time per step (the GPU's busy time: one stream, so
kernels never overlap) against the wall time per step, and that busy time split by kernel name
into attention, MoE, dense GEMMs, norms/rope, sampling and the rest. Writes the table and the
profiler's kernel list to --out.
"""

import argparse
import random
import re
import time
from pathlib import Path

import torch

from mlaserve.engine.args import EngineArgs
from mlaserve.engine.core import EngineCore
from mlaserve.engine.messages import EngineCoreRequest
from mlaserve.engine.request import SamplingParams

# first match wins; names as CUPTI reports them (Triton kernels keep their Python names)
KINDS = [
    ("attention", r"mla_decode|BatchMLA|flashinfer|Mla|merge_kernel"),
    ("prefill attn", r"fmha|flash_fwd|FlashAttn|attention|sdpa"),
    ("moe", r"gate_up_silu|_down_kernel|moe|grouped|_count_kernel|_offsets_kernel|_scatter"),
    ("norm/rope", r"rms|rope|norm|latent"),
    ("sampling", r"gumbel|argmax|softmax|sort|topk|index_put"),
    ("dense gemm", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|Kernel2"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def profile_prefill(core: EngineCore, rng: random.Random, args: argparse.Namespace) -> list[str]:
    """Time a second wave of prompts' prefill (kernels compiled by now), GPU time by kind."""
    core.abort_requests(list(core.requests))
    while core.has_unfinished:
        core.step()
    vocab = core.config.model.vocab_size
    num_prompts = max(8, core.config.scheduler.max_num_batched_tokens // args.prompt_len * 4)
    for i in range(num_prompts):
        ids = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        core.add_request(EngineCoreRequest(f"p{i}", ids, SamplingParams(
            max_tokens=1, ignore_eos=True), sample_seed=i))
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        steps = 0
        while core.has_unfinished:
            core.step()
            steps += 1
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    by_kind: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kind_of(event.name)] = by_kind.get(kind_of(event.name), 0.0) + (
                event.device_time)
            by_kernel[event.name] = by_kernel.get(event.name, 0.0) + event.device_time
    tokens = num_prompts * args.prompt_len
    lines = [f"prefill of {num_prompts} x {args.prompt_len} tokens: {steps} steps, "
             f"{seconds:.2f} s = {tokens / seconds:.0f} tok/s (profiled); GPU busy "
             f"{sum(by_kind.values()) / 1e6:.2f} s"]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<12} {us / 1e3:9.1f} ms")
    lines.append("  top kernels (ms, kind, name):")
    for name, us in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:20]:
        lines.append(f"  {us / 1e3:9.1f}  {kind_of(name):<11} {name[:110]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--out", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    core = EngineCore(EngineArgs(model=args.model, load_format="dummy",
                                 block_size=args.block_size, max_num_seqs=args.batch,
                                 attention_backend=args.backend,
                                 enforce_eager=args.enforce_eager))
    print(f"engine built in {time.perf_counter() - started:.1f} s "
          f"(backend {core.info.attention_backend})")
    rng = random.Random(0)
    vocab = core.config.model.vocab_size
    for i in range(args.batch):
        ids = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        core.add_request(EngineCoreRequest(str(i), ids, SamplingParams(
            max_tokens=args.steps * 3 + 64, ignore_eos=True), sample_seed=i))
    started = time.perf_counter()
    steps = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.requests.values()):
        core.step()
        steps += 1
    torch.cuda.synchronize()
    print(f"prefill: {steps} steps in {time.perf_counter() - started:.2f} s")
    for _ in range(8):
        core.step()
    torch.cuda.synchronize()

    started = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) / args.steps * 1e3
    print(f"decode step at batch {args.batch} (pipelined, wall): {wall_ms:.2f} ms "
          f"= {args.batch / wall_ms * 1e3:.0f} tok/s")

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        torch.cuda.synchronize()
        profiled_wall_ms = (time.perf_counter() - started) / args.steps * 1e3
    by_kind: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time
        by_kind[kind_of(event.name)] = by_kind.get(kind_of(event.name), 0.0) + us
        by_kernel[event.name] = by_kernel.get(event.name, 0.0) + us
    busy_ms = sum(by_kind.values()) / args.steps / 1e3
    lines = [f"batch {args.batch}, prompt {args.prompt_len}, backend {core.info.attention_backend}"
             f", {args.steps} steps",
             f"wall per step {wall_ms:.2f} ms (under the profiler {profiled_wall_ms:.2f} ms)",
             f"GPU busy per step {busy_ms:.2f} ms; host gap {profiled_wall_ms - busy_ms:.2f} ms "
             f"({(profiled_wall_ms - busy_ms) / profiled_wall_ms:.1%} of the profiled step)",
             "", f"{'kind':<12} {'ms/step':>8} {'share':>7}"]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        ms = us / args.steps / 1e3
        lines.append(f"{kind:<12} {ms:8.3f} {ms / busy_ms:7.1%}")
    lines += ["", "top kernels (ms/step, kind, name):"]
    for name, us in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]:
        lines.append(f"{us / args.steps / 1e3:8.3f}  {kind_of(name):<11} {name[:110]}")
    lines += ["", *profile_prefill(core, rng, args)]
    report = "\n".join(lines)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile-{args.backend}-b{args.batch}.txt").write_text(report + "\n")


if __name__ == "__main__":
    main()
