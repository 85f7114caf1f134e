"""Backend names, lazy imports, `auto` selection, and the one-call `mla_decode` entry point."""

import importlib
import logging
import os

import torch

from mlaserve.attention.base import MLABackend, MLAShape

logger = logging.getLogger(__name__)

ENV_VAR = "MLASERVE_ATTENTION_BACKEND"

# name -> "module:Class", imported only when the backend is used.
_BACKENDS: dict[str, str] = {
    "torch": "mlaserve.attention.torch_backend:TorchMLABackend",
    "triton": "mlaserve.attention.triton_backend:TritonMLABackend",
    "flashinfer": "mlaserve.attention.flashinfer_backend:FlashInferMLABackend",
}
# vLLM's names for the same backends.
_ALIASES = {"triton_mla": "triton", "flashinfer_mla": "flashinfer"}
# vLLM backends that do not exist here, with what to use instead.
_NOT_HERE = {
    "flashmla": "FlashMLA is not bundled; use 'flashinfer' (fastest on SM90/SM100) or 'triton'",
    "cutlass_mla": "CUTLASS MLA is not bundled; use 'flashinfer' (its SM100 trtllm-gen path) "
    "or 'triton'",
    "flash_attn_mla": "FlashAttention MLA is not bundled; use 'flashinfer' or 'triton'",
}


def available_backends() -> list[str]:
    """Names of the registered backends (whether they can run here is `supports()`'s answer)."""
    return list(_BACKENDS)


def resolve_backend_name(name: str | None) -> str:
    """Map a user-given name (any case, vLLM names accepted, None -> env var or 'auto')."""
    if name is None or name == "":
        name = os.environ.get(ENV_VAR, "auto")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _NOT_HERE:
        raise ValueError(f"attention backend '{name}': {_NOT_HERE[key]}")
    if key != "auto" and key not in _BACKENDS:
        raise ValueError(f"unknown attention backend '{name}'; choose one of "
                         f"{['auto', *_BACKENDS]} (or vLLM's TRITON_MLA, FLASHINFER_MLA)")
    return key


def backend_class(name: str) -> type[MLABackend]:
    """Import and return the class registered under a canonical name."""
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def _auto_candidates(shape: MLAShape) -> list[str]:
    if shape.device.type == "cpu":
        return ["torch"]  # the Triton interpreter is a test tool, not a CPU fast path
    return ["flashinfer", "triton", "torch"]


def select_backend(name: str | None, shape: MLAShape) -> type[MLABackend]:
    """The backend class to use: the named one (an error if it cannot serve `shape`) or `auto`."""
    key = resolve_backend_name(name)
    if key != "auto":
        cls = backend_class(key)
        reasons = cls.supports(shape)
        if reasons:
            raise ValueError(f"attention backend '{key}' cannot serve this model here: "
                             + "; ".join(reasons))
        return cls
    rejected = []
    candidates = []
    for candidate in _auto_candidates(shape):
        try:
            cls = backend_class(candidate)
        except ImportError as exc:
            rejected.append(f"{candidate}: {exc}")
            continue
        reasons = cls.supports(shape)
        if reasons:
            rejected.append(f"{candidate}: {'; '.join(reasons)}")
        else:
            candidates.append(cls)
    best = max(candidates, key=lambda c: c.auto_priority)
    logger.info("attention backend auto -> %s%s", best.name,
                f" (skipped {' | '.join(rejected)})" if rejected else "")
    return best


def create_backend(name: str | None, shape: MLAShape, softmax_scale: float) -> MLABackend:
    """Build the chosen backend for `shape`."""
    return select_backend(name, shape)(shape, softmax_scale)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    kv_lora_rank: int | None = None,
    q_len: int = 1,
    backend: str | MLABackend = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode in one call (plan + run). See DESIGN §3.

    Args:
        q: [B * q_len, H, L + R] absorbed queries.
        kv_cache: [num_blocks, block_size, L + R] latent cache.
        block_table: [B, max_blocks] int32.
        seq_lens: [B] int32, KV length including the q_len new tokens.
        softmax_scale: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale**2 under YaRN.
        kv_lora_rank: L; defaults to 512 when the row is 576 wide, else the row width minus 64.
        q_len: new tokens per request, causal among themselves.
        backend: a name or a built backend.

    Returns:
        o [B * q_len, H, L] (and lse [B * q_len, H] float32, natural log).
    """
    head_dim = q.shape[-1]
    if kv_lora_rank is None:
        kv_lora_rank = head_dim - 64
    if isinstance(backend, MLABackend):
        impl = backend
    else:
        shape = MLAShape(
            num_heads=q.shape[1], kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=head_dim - kv_lora_rank, block_size=kv_cache.shape[1],
            dtype=q.dtype, device=q.device, max_q_len=q_len)
        impl = create_backend(backend, shape, softmax_scale)
    impl.plan(block_table, seq_lens, q_len)
    return impl.run(q, kv_cache, return_lse=return_lse)
