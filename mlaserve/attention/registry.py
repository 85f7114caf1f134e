"""Backend names, lazy imports, `auto` selection, and the one-call `mla_decode` entry point.

A name is resolved once (`resolve_backend_name`) and a backend checked once for a shape: its
constructor runs `supports()` and raises `UnsupportedShape` with the reasons; `create_backend`
builds the named backend, or under `auto` tries the candidates in order of preference and keeps
the first that builds. The `triton` name means the plan-dispatched decode of
`mlaserve.kernels.mla_decode` (the Triton split pass, or the Gluon pass on sm_90): its
`describe_plan()` names the kernel a step runs.
"""

import importlib
import logging
import os

import torch

from mlaserve.attention.base import MLABackend, MLAShape, UnsupportedShape

logger = logging.getLogger(__name__)

ENV_VAR = "MLASERVE_ATTENTION_BACKEND"

# name -> "module:Class", imported only when the backend is used.
_BACKENDS: dict[str, str] = {
    "torch": "mlaserve.attention.torch_backend:TorchMLABackend",
    "triton": "mlaserve.attention.triton_backend:TritonMLABackend",
    "flashinfer": "mlaserve.attention.flashinfer_backend:FlashInferMLABackend",
}
# Peers that `mlaserve bench kernel` times beside the backends; never served, never `auto`.
_PEERS: dict[str, str] = {
    "flashinfer-fa2": "mlaserve.attention.flashinfer_backend:FlashInferFA2MLABackend",
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


def peer_backends() -> list[str]:
    """Names of the benchmark-only peers (`resolve_backend_name(..., peers=True)`)."""
    return list(_PEERS)


def resolve_backend_name(name: str | None, peers: bool = False) -> str:
    """Map a user-given name (any case, vLLM names accepted, None -> env var or 'auto') to a
    canonical one; with peers, the benchmark-only peers' names too. Raises on unknown names."""
    if name is None or name == "":
        name = os.environ.get(ENV_VAR, "auto")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _NOT_HERE:
        raise ValueError(f"attention backend '{name}': {_NOT_HERE[key]}")
    known = [*_BACKENDS, *(_PEERS if peers else ())]
    if key != "auto" and key not in known:
        raise ValueError(f"unknown attention backend '{name}'; choose one of "
                         f"{['auto', *known]} (or vLLM's TRITON_MLA, FLASHINFER_MLA)")
    return key


def backend_class(name: str) -> type[MLABackend]:
    """Import and return the class registered under a canonical name (backend or peer)."""
    module_name, class_name = (_BACKENDS | _PEERS)[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def _auto_candidates(shape: MLAShape) -> list[str]:
    """Names `auto` tries for the shape, most preferred first."""
    if shape.device.type == "cpu":
        return ["torch"]  # the Triton interpreter is a test tool, not a CPU fast path
    if shape.max_q_len > 1:
        # speculative decoding: the MTP module's k passes replay in one CUDA graph only where
        # the backend's graphs read their lengths on the device (FlashInfer plans on the host,
        # so its drafting runs eagerly, several times slower at one user)
        return ["triton", "flashinfer", "torch"]
    return ["flashinfer", "triton", "torch"]


def _explicit(key: str, shape: MLAShape) -> type[MLABackend]:
    cls = backend_class(key)
    reasons = cls.supports(shape)
    if reasons:
        raise UnsupportedShape(key, shape, reasons)
    return cls


def select_backend(name: str | None, shape: MLAShape) -> type[MLABackend]:
    """The backend class for `shape`, without building it: the named one (an error if it cannot
    serve `shape`) or `auto`'s first candidate that can."""
    key = resolve_backend_name(name)
    if key != "auto":
        return _explicit(key, shape)
    rejected = []
    for candidate in _auto_candidates(shape):
        try:
            chosen = _explicit(candidate, shape)
        except (ImportError, UnsupportedShape) as exc:
            rejected.append(f"{candidate}: {exc}")
            continue
        logger.info("attention backend auto -> %s%s", candidate,
                    f" (skipped {' | '.join(rejected)})" if rejected else "")
        return chosen
    raise ValueError("no attention backend can serve this shape: " + " | ".join(rejected))


def create_backend(name: str | None, shape: MLAShape, softmax_scale: float) -> MLABackend:
    """Build the named backend for `shape` (its constructor checks it once), or under `auto`
    the first candidate that builds; logs what `auto` chose and skipped."""
    key = resolve_backend_name(name)
    if key != "auto":
        return backend_class(key)(shape, softmax_scale)
    rejected = []
    for candidate in _auto_candidates(shape):
        try:
            backend = backend_class(candidate)(shape, softmax_scale)
        except ImportError as exc:
            rejected.append(f"{candidate}: {exc}")
            continue
        except UnsupportedShape as exc:
            rejected.append(f"{candidate}: {'; '.join(exc.reasons)}")
            continue
        logger.info("attention backend auto -> %s%s", backend.name,
                    f" (skipped {' | '.join(rejected)})" if rejected else "")
        return backend
    raise ValueError("no attention backend can serve this shape: " + " | ".join(rejected))


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
    """Paged MLA decode in one call (plan + run). The contract: docs/architecture.md, "Contracts".

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
