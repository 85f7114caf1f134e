"""The element type of the paged latent cache (`--kv-cache-dtype`).

"auto" stores the latents [c_kv | k_pe] in the model's dtype. "fp8" (or "fp8_e4m3", vLLM's
names) stores them as float8_e4m3fn with scale 1: both MLA decode reads (c_kv as keys and values,
k_pe as rope keys) then move half the bytes of bf16, and the readers convert to the query's
dtype. Scale 1 is what vLLM's FP8 cache uses without calibrated scales: c_kv leaves an RMSNorm
(unit RMS times the norm's weight) and k_pe a rotation, so both sit well inside e4m3's +-448
(larger values saturate: `kernels.fp8_blocks.saturating_cast`, as the cache write stores them);
its 3 mantissa bits round each element by at most 2^-4 relative.
"""

import torch

from mlaserve.option_values import KV_CACHE_DTYPE_NAMES

# name -> the cache's element type (None: the model's dtype)
KV_CACHE_DTYPES = {name: None if name == "auto" else torch.float8_e4m3fn
                   for name in KV_CACHE_DTYPE_NAMES}


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for `--kv-cache-dtype name` under a model in `dtype`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype '{name}'; use one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or dtype

