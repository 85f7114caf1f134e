"""DeepGEMM's block-FP8 product, an optional peer of the products in `fp8_gemm.py`.

DeepGEMM (the `deep_gemm` module of the `sgl-deep-gemm` wheels, which compile their kernels at
run time with the CUDA toolkit's compiler) multiplies the same operands as
`fp8_gemm.block_fp8_matmul`: x_q [M, K] float8_e4m3fn with float32 scales per token and 128
columns [M, ceil(K / 128)], and W [N, K] float8_e4m3fn with float32 scales per 128x128 block
[ceil(N / 128), ceil(K / 128)] (DeepSeek's checkpoint layout), into a bfloat16 y [M, N] = x W^T.
On sm_90 it moves the activation scales into the MN-major, TMA-aligned layout its kernels read
itself. It is what vLLM and SGLang run on Hopper for DeepSeek's block-FP8 Linears.

`load_deep_gemm()` imports it once: the module, or None with `deep_gemm_unavailable_reason()`
saying why (not installed, no sm_90 GPU, its library failed to load). Nothing else in the
package imports `deep_gemm`.
"""

import torch

from mlaserve.kernels.fp8_gemm_common import check_operands

_loaded: tuple[object | None, str] | None = None  # (module or None, why not)


def load_deep_gemm() -> object | None:
    """The `deep_gemm` module where it runs here (an sm_90 GPU), else None."""
    global _loaded
    if _loaded is None:
        _loaded = _import()
    return _loaded[0]


def deep_gemm_unavailable_reason() -> str:
    """Why `load_deep_gemm()` gave None ("" when it did not)."""
    load_deep_gemm()
    assert _loaded is not None
    return _loaded[1]


def _import() -> tuple[object | None, str]:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return None, "DeepGEMM's block-FP8 product runs on sm_90 GPUs (H100, H200)"
    try:
        import deep_gemm
    except ImportError:
        return None, ("deep_gemm is not installed (pip install sgl-deep-gemm; it needs the "
                      "CUDA toolkit at run time)")
    except (OSError, RuntimeError, AssertionError) as exc:  # its library or toolkit
        return None, f"deep_gemm failed to load: {str(exc).splitlines()[0][:200]}"
    if not hasattr(deep_gemm, "fp8_gemm_nt"):
        return None, "this deep_gemm has no fp8_gemm_nt (DeepGEMM 2.x API expected)"
    return deep_gemm, ""


def deep_gemm_block_fp8_matmul(x_q: torch.Tensor, x_scales: torch.Tensor,
                               weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y [M, N] = dequant(x_q, x_scales) @ dequant(weight, weight_scale_inv)^T by DeepGEMM,
    rounded to bfloat16 (its output type), then cast to out_dtype.

    Args:
        x_q: [M, K] float8_e4m3fn, x_scales [M, ceil(K / 128)] float32
            (`fp8_activations.quantize_activations`).
        weight: [N, K] float8_e4m3fn, weight_scale_inv [ceil(N / 128), ceil(K / 128)] float32.
    RuntimeError where DeepGEMM is not available (`deep_gemm_unavailable_reason`).
    """
    deep_gemm = load_deep_gemm()
    if deep_gemm is None:
        raise RuntimeError(deep_gemm_unavailable_reason())
    check_operands(x_q, weight, weight_scale_inv, x_scales)
    y = torch.empty(x_q.shape[0], weight.shape[0], dtype=torch.bfloat16, device=x_q.device)
    deep_gemm.fp8_gemm_nt((x_q.contiguous(), x_scales.float()),
                          (weight.contiguous(), weight_scale_inv.float().contiguous()), y)
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)
