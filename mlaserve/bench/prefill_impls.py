"""The prefill attention implementations `mlaserve bench prefill` times, their float32
reference, and the timing loop. Usage: `mlaserve bench prefill --help`."""

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from mlaserve.attention.metadata import PrefillChunk
from mlaserve.attention.prefill import expanded_prefill

NOPE, ROPE, V, RANK = 128, 64, 128, 512
STEPS = {  # name -> [(new tokens, context tokens)] per chunk
    "8x1024": [(1024, 0)] * 8,
    "1x8192": [(8192, 0)],
    "1024+ctx3072": [(1024, 3072)],
    "4x512+ctx512": [(512, 512)] * 4,
    # short prompts of lengths met for the first time (one user's questions): what the first
    # call at a new shape costs (cuDNN builds an execution plan per shape)
    "1x37": [(37, 0)],
    "1x53+ctx64": [(53, 64)],
}


def make_step(chunks: list[tuple[int, int]], heads: int, device: torch.device):
    """Random q, new latents, a cache of context latents, kv_b and the chunks' metadata."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    total_new = sum(n for n, _ in chunks)
    total_ctx = sum(c for _, c in chunks)
    q = torch.randn(total_new, heads, NOPE + ROPE, generator=gen).to(device, torch.bfloat16)
    latent = torch.randn(total_new, RANK + ROPE, generator=gen).to(device, torch.bfloat16)
    cache = torch.randn(total_ctx + 64, RANK + ROPE, generator=gen).to(device, torch.bfloat16)
    kv_b = (torch.randn(heads * (NOPE + V), RANK, generator=gen) / RANK ** 0.5).to(
        device, torch.bfloat16)
    metas, start, ctx_start = [], 0, 0
    for n, c in chunks:
        slots = torch.arange(ctx_start, ctx_start + c, device=device) if c else None
        metas.append(PrefillChunk(start, n, c, slots))
        start, ctx_start = start + n, ctx_start + c
    return q, latent, cache, kv_b, metas


def run_sdpa(q, latent, cache, kv_b, metas, heads, scale):
    """The engine's `expanded_prefill`, one call per chunk."""
    out = q.new_empty(q.shape[0], heads, V)
    for chunk in metas:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        out[rows] = expanded_prefill(q[rows], latent[rows], cache, chunk, kv_b, heads, NOPE, V,
                                     RANK, scale)
    return out


def keys_and_values(lat, kv_b, heads):
    """Latent rows [S, L + R] -> k [S, H, P + R] = [k_nope | k_pe], v [S, H, V]."""
    s = lat.shape[0]
    kv = F.linear(lat[:, :RANK], kv_b).view(s, heads, NOPE + V)  # [S, H * (P + V)] -> [S, H, P + V]
    k = torch.empty(s, heads, NOPE + ROPE, dtype=lat.dtype, device=lat.device)
    k[..., :NOPE] = kv[..., :NOPE]
    k[..., NOPE:] = lat[:, None, RANK:]
    return k, kv[..., NOPE:]


def run_sdpa_4d(q, latent, cache, kv_b, metas, heads, scale, backend=None, pad_v=False):
    """SDPA on 4-d [1, H, S, dim] inputs (the fused kernels need a batch dim), causal aligned
    bottom-right; backend None lets torch choose."""
    out = q.new_empty(q.shape[0], heads, V)
    for chunk in metas:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        lat = latent[rows]
        if chunk.context_len:
            lat = torch.cat((cache[chunk.context_slots], lat))
        s = lat.shape[0]
        k, v = keys_and_values(lat, kv_b, heads)
        if pad_v:
            v = F.pad(v, (0, NOPE + ROPE - V))
        n = chunk.num_tokens
        mask = causal_lower_right(n, s) if chunk.context_len else None
        args = (q[rows].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        if backend is None:
            o = F.scaled_dot_product_attention(*args, attn_mask=mask, is_causal=mask is None,
                                               scale=scale)
        else:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(*args, attn_mask=mask,
                                                   is_causal=mask is None, scale=scale)
        out[rows] = o[0].transpose(0, 1)[..., :V]
    return out


def make_flashinfer(heads: int, device: torch.device):
    """FlashInfer's ragged prefill over the expanded keys and values of all chunks at once."""
    import flashinfer

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")

    def run(q, latent, cache, kv_b, metas, heads_, scale):
        lats = []
        qo, kvp = [0], [0]
        for chunk in metas:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            lat = latent[rows]
            if chunk.context_len:
                lat = torch.cat((cache[chunk.context_slots], lat))
            lats.append(lat)
            qo.append(qo[-1] + chunk.num_tokens)
            kvp.append(kvp[-1] + lat.shape[0])
        k, v = keys_and_values(torch.cat(lats), kv_b, heads)
        qo_t = torch.tensor(qo, dtype=torch.int32, device=device)
        kv_t = torch.tensor(kvp, dtype=torch.int32, device=device)
        wrapper.plan(qo_t, kv_t, heads, heads, NOPE + ROPE, head_dim_vo=V, causal=True,
                     sm_scale=scale, q_data_type=q.dtype, kv_data_type=q.dtype)
        return wrapper.run(q, k, v)

    return run


def reference(q, latent, cache, kv_b, metas, heads, scale):
    """The step's attention in float32, keys and values expanded from the same latents."""
    out = torch.empty(q.shape[0], heads, V, dtype=torch.float32, device=q.device)
    for chunk in metas:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        lat = latent[rows].float()
        if chunk.context_len:
            lat = torch.cat((cache[chunk.context_slots].float(), lat))
        s, n = lat.shape[0], chunk.num_tokens
        kv = F.linear(lat[:, :RANK], kv_b.float()).view(s, heads, NOPE + V)
        k = torch.cat((kv[..., :NOPE], lat[:, None, RANK:].expand(-1, heads, -1)), -1)
        scores = torch.einsum("nhd,shd->hns", q[rows].float(), k) * scale
        visible = torch.arange(s, device=q.device)[None] <= (s - n + torch.arange(
            n, device=q.device))[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hns,shd->nhd", probs, kv[..., NOPE:])
    return out


def time_ms(fn: Callable[[], torch.Tensor], reps: int = 20) -> float:
    """The best of three rounds of `reps` eager calls, ms per call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / reps * 1e3)
    return min(times)


def implementations(wanted: list[str], heads: int, device: torch.device) -> dict:
    """The implementations `wanted` names (sdpa, 4d, flashinfer), by their row label."""
    impls = {}
    if "sdpa" in wanted:
        impls["engine expanded_prefill"] = run_sdpa
    if "4d" in wanted:
        impls["4d auto"] = run_sdpa_4d
        impls["4d efficient"] = lambda *a: run_sdpa_4d(*a, backend=SDPBackend.EFFICIENT_ATTENTION)
        impls["4d flash pad v"] = lambda *a: run_sdpa_4d(
            *a, backend=SDPBackend.FLASH_ATTENTION, pad_v=True)
        impls["4d cudnn pad v"] = lambda *a: run_sdpa_4d(
            *a, backend=SDPBackend.CUDNN_ATTENTION, pad_v=True)
        impls["4d cudnn"] = lambda *a: run_sdpa_4d(*a, backend=SDPBackend.CUDNN_ATTENTION)
    if "flashinfer" in wanted:
        try:
            impls["flashinfer ragged"] = make_flashinfer(heads, device)
        except Exception as error:  # noqa: BLE001
            print(f"flashinfer unavailable: {error!r}")
    return impls


def time_implementations(heads: int, wanted: list[str], device: torch.device) -> list[str]:
    """One line per (step shape, implementation): ms per layer-step, TFLOP/s, the largest
    absolute error against the reference and the first call's seconds; printed as they come."""
    scale = (NOPE + ROPE) ** -0.5
    impls = implementations(wanted, heads, device)
    lines = [f"{heads} heads, qk {NOPE}+{ROPE}, v {V}, bf16; ms per layer-step, max abs err"]
    for step, chunks in STEPS.items():
        inputs = make_step(chunks, heads, device)
        ref = reference(*inputs, heads, scale)
        for name, fn in impls.items():
            try:
                started = time.perf_counter()
                out = fn(*inputs, heads, scale)
                torch.cuda.synchronize()
                first = time.perf_counter() - started
                err = (out.float() - ref).abs().max().item()
                ms = time_ms(lambda fn=fn, inputs=inputs: fn(*inputs, heads, scale))
                flops = sum(4 * n * (c + (n + 1) / 2) * heads * (NOPE + ROPE + V) / 2
                            for n, c in chunks)
                lines.append(f"{step:<14} {name:<20} {ms:8.3f} ms  {flops / ms / 1e9:6.0f} "
                             f"TFLOP/s  err {err:.2e}  (first call {first * 1e3:.1f} ms)")
            except Exception as error:  # noqa: BLE001
                lines.append(f"{step:<14} {name:<20} failed: {error!r}"[:300])
            print(lines[-1], flush=True)
    return lines
