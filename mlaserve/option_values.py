"""The fixed value sets of engine options, torch-free so that `mlaserve --help` and argument
parsing import no torch; what each value does is decided where the option is applied."""

# `quantization`: auto (FP8 checkpoints keep FP8 Linear weights where the GPU has FP8 tensor
# cores), none (dequantize FP8 weights on load to the model dtype), fp8 (keep them FP8 on any
# device). `mlaserve.model.fp8.keep_fp8_weights` applies it.
QUANTIZATION_MODES = ("auto", "none", "fp8")

# `kv_cache_dtype`: auto (the model's dtype), fp8 / fp8_e4m3 (vLLM's names for float8_e4m3fn).
# `mlaserve.cache.latent_dtype.KV_CACHE_DTYPES` maps them to torch dtypes.
KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3")
