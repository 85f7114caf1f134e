"""The GPU profile of `mlaserve bench step`: wall time per decode step, GPU busy time, and the
GPU time by kind of kernel (attention, MoE, dense GEMMs, norms/rope, sampling, other), then the
same split for the prefill of a second wave of prompts. Usage: `mlaserve bench step --help`."""

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
    ("fp8 quant", r"quantize_groups"),
    ("attention", r"mla_decode|BatchMLA|flashinfer|Mla|merge_kernel"),
    ("prefill attn", r"fmha|flash_fwd|FlashAttn|attention|sdpa"),
    ("moe", r"gate_up_silu|_down_kernel|moe|grouped|_count_kernel|_offsets_kernel|_scatter"),
    ("norm/act", r"rms|rope|norm|latent|silu_and_mul"),
    ("sampling", r"gumbel|argmax|softmax|sort|topk|index_put"),
    ("dense gemm", r"gemm|matmul|sum_splits|nvjet|cutlass|xmma|cublas|sm90_|Kernel2"),
]


def kind_of(name: str) -> str:
    """The kind of a kernel, by the first pattern of KINDS its name matches."""
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def _device_times(prof) -> tuple[dict[str, float], dict[str, float]]:
    """The profiled kernels' device µs summed by kind and by kernel name."""
    by_kind: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time
        by_kind[kind_of(event.name)] = by_kind.get(kind_of(event.name), 0.0) + us
        by_kernel[event.name] = by_kernel.get(event.name, 0.0) + us
    return by_kind, by_kernel


def profile_prefill(core: EngineCore, rng: random.Random, prompt_len: int) -> list[str]:
    """Time a second wave of prompts' prefill (kernels compiled by now), GPU time by kind."""
    core.abort_requests(list(core.requests))
    while core.has_unfinished:
        core.step()
    vocab = core.config.model.vocab_size
    num_prompts = max(8, core.config.scheduler.max_num_batched_tokens // prompt_len * 4)
    for i in range(num_prompts):
        ids = [rng.randrange(3, vocab) for _ in range(prompt_len)]
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
    by_kind, by_kernel = _device_times(prof)
    tokens = num_prompts * prompt_len
    lines = [f"prefill of {num_prompts} x {prompt_len} tokens: {steps} steps, "
             f"{seconds:.2f} s = {tokens / seconds:.0f} tok/s (profiled); GPU busy "
             f"{sum(by_kind.values()) / 1e6:.2f} s"]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<12} {us / 1e3:9.1f} ms")
    lines.append("  top kernels (ms, kind, name):")
    for name, us in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:20]:
        lines.append(f"  {us / 1e3:9.1f}  {kind_of(name):<11} {name[:110]}")
    return lines


def profile_steps(model: str, backend: str, batch: int, prompt_len: int, steps: int,
                  block_size: int, out: str | None, enforce_eager: bool,
                  quantization: str = "auto", kv_cache_dtype: str = "auto",
                  speculative_config: dict | None = None) -> None:
    """Build the engine core, prefill, time and profile decode steps, then profile a prefill;
    print the report and write it to out/profile-BACKEND-bBATCH[-wQUANT][-kvDTYPE][-mtpK].txt
    where out is given. With speculative_config a step verifies and drafts (the dummy MTP
    layer's drafts are rarely accepted: the step's cost, not its yield)."""
    started = time.perf_counter()
    core = EngineCore(EngineArgs(model=model, load_format="dummy", block_size=block_size,
                                 max_num_seqs=batch, attention_backend=backend,
                                 enforce_eager=enforce_eager, quantization=quantization,
                                 kv_cache_dtype=kv_cache_dtype,
                                 speculative_config=speculative_config))
    print(f"engine built in {time.perf_counter() - started:.1f} s "
          f"(backend {core.info.attention_backend})")
    rng = random.Random(0)
    vocab = core.config.model.vocab_size
    for i in range(batch):
        ids = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        core.add_request(EngineCoreRequest(str(i), ids, SamplingParams(
            max_tokens=steps * 3 + 64, ignore_eos=True), sample_seed=i))
    started = time.perf_counter()
    prefill_steps = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.requests.values()):
        core.step()
        prefill_steps += 1
    torch.cuda.synchronize()
    print(f"prefill: {prefill_steps} steps in {time.perf_counter() - started:.2f} s")
    for _ in range(8):
        core.step()
    torch.cuda.synchronize()

    started = time.perf_counter()
    emitted = 0
    for _ in range(steps):
        emitted += sum(len(output.new_token_ids) for output in core.step())
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) / steps * 1e3
    print(f"decode step at batch {batch} (pipelined unless speculating, wall): {wall_ms:.2f} ms"
          f", {emitted / steps:.1f} tokens a step = {emitted / steps / wall_ms * 1e3:.0f} tok/s")

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
        profiled_wall_ms = (time.perf_counter() - started) / steps * 1e3
    by_kind, by_kernel = _device_times(prof)
    busy_ms = sum(by_kind.values()) / steps / 1e3
    lines = [f"batch {batch}, prompt {prompt_len}, backend {core.info.attention_backend}"
             f", quantization {quantization}, kv cache {kv_cache_dtype}, {steps} steps",
             f"wall per step {wall_ms:.2f} ms (under the profiler {profiled_wall_ms:.2f} ms)",
             f"GPU busy per step {busy_ms:.2f} ms; host gap {profiled_wall_ms - busy_ms:.2f} ms "
             f"({(profiled_wall_ms - busy_ms) / profiled_wall_ms:.1%} of the profiled step)",
             "", f"{'kind':<12} {'ms/step':>8} {'share':>7}"]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        ms = us / steps / 1e3
        lines.append(f"{kind:<12} {ms:8.3f} {ms / busy_ms:7.1%}")
    lines += ["", "top kernels (ms/step, kind, name):"]
    for name, us in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]:
        lines.append(f"{us / steps / 1e3:8.3f}  {kind_of(name):<11} {name[:110]}")
    lines += ["", *profile_prefill(core, rng, prompt_len)]
    report = "\n".join(lines)
    print(report)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        k = (speculative_config or {}).get("num_speculative_tokens", "auto")
        suffix = "".join(f"-{tag}{value}" for tag, value in (("w", quantization),
                                                                ("kv", kv_cache_dtype),
                                                                ("mtp", k))
                         if value != "auto")
        (folder / f"profile-{backend}-b{batch}{suffix}.txt").write_text(report + "\n")
