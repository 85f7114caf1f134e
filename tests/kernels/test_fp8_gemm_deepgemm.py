"""DeepGEMM's block-FP8 product (optional) against the float32 product of the same dequantized
operands, on DeepSeek's shapes; skipped where deep_gemm does not run (no sm_90 GPU, not
installed). One dropped 128-column K block moves the product far past the bound."""

import pytest
import torch

from mlaserve.bench.gemm import BF16_ROUNDING, FP8_MMA_REL_ERR
from mlaserve.kernels.fp8_activations import quantize_activations
from mlaserve.kernels.fp8_blocks import quantize_block_fp8
from mlaserve.kernels.fp8_gemm import block_fp8_reference
from mlaserve.kernels.fp8_gemm_deepgemm import (
    deep_gemm_block_fp8_matmul,
    deep_gemm_unavailable_reason,
    load_deep_gemm,
)
from mlaserve.kernels.testing import relative_error


def test_unavailable_is_said_not_raised() -> None:
    if load_deep_gemm() is None:
        assert deep_gemm_unavailable_reason()
        with pytest.raises(RuntimeError):
            deep_gemm_block_fp8_matmul(*[torch.empty(0)] * 4)
    else:
        assert deep_gemm_unavailable_reason() == ""


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 300, 4096])
@pytest.mark.parametrize("out_features,in_features", [(2112, 7168), (24576, 1536),
                                                      (7168, 2048), (4096, 7168)])
def test_matches_the_float32_product(rows: int, out_features: int, in_features: int) -> None:
    if load_deep_gemm() is None:
        pytest.skip(deep_gemm_unavailable_reason())
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, in_features, device="cuda", generator=gen).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02
    x_q, x_scales = quantize_activations(x)
    w_fp8, w_scales = quantize_block_fp8(weight)
    want = block_fp8_reference(x_q, x_scales, w_fp8, w_scales)  # float32
    got = deep_gemm_block_fp8_matmul(x_q, x_scales, w_fp8, w_scales)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert relative_error(got.float(), want) <= FP8_MMA_REL_ERR + BF16_ROUNDING
    # one K block dropped from the weight is far outside the bound
    dropped = w_fp8.clone()
    dropped[:, :128] = 0
    assert relative_error(deep_gemm_block_fp8_matmul(x_q, x_scales, dropped, w_scales).float(),
                          want) > 10 * (FP8_MMA_REL_ERR + BF16_ROUNDING)
