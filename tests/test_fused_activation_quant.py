"""The kernels that quantize their output for a w8a8 block-FP8 product (RMSNorm, the residual
add and norm, SiLU-and-mul with `quantize=True`) against their own unquantized output quantized
per token and 128 columns in torch, and the Linears that read such input.

Without a CUDA GPU the kernels run in Triton's CPU interpreter, whose float32 -> FP8 conversion
is wrong (`fp8_activations`): there the values are stored in float32, unrounded, and the test
compares them with the torch quotient exactly; on a GPU the FP8 bits must equal torch's
rounding of that quotient. Widths that are no multiple of 128 (and one under 128) end in a
partial group; sources are strided views.
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from mlaserve.kernels.fp8_blocks import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    QuantizedActivations,
    dequantize_block_fp8,
    quantize_block_fp8,
)
from mlaserve.kernels.fused_norm_rope import (  # noqa: E402
    fused_add_rms_norm,
    rms_norm,
    silu_and_mul,
)
from mlaserve.model.fp8_linear import linear  # noqa: E402

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or TRITON_INTERPRET=1")

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
EPS = 1e-6


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _assert_quantizes(quantized: QuantizedActivations, dense: torch.Tensor) -> None:
    """quantized holds dense [T, N] (the kernel's own unquantized output) quantized per token
    and 128 columns: scales amax / 448 (1 for a zero group), M-major; values dense / scale,
    saturated, in the values' dtype (FP8 on CUDA: torch's rounding), bit for bit."""
    rows, cols = dense.shape
    groups = -(-cols // 128)
    padded = F.pad(dense.float(), (0, groups * 128 - cols)).view(rows, groups, 128)
    amax = padded.abs().amax(dim=-1)  # [T, G]
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    values = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).view(rows, -1)[:, :cols]
    assert quantized.dtype == dense.dtype and quantized.shape == (rows, cols)
    assert quantized.values.dtype == (FP8_DTYPE if ON_GPU else torch.float32)
    assert rows < 2 or quantized.scales.stride() == (1, rows)  # M-major
    assert torch.equal(quantized.scales, scales)
    assert torch.equal(quantized.values.float(), values.to(quantized.values.dtype).float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden_size", [(1, 40), (5, 200), (3, 384)])
def test_rms_norm_quantized_is_the_norm_then_quantized(dtype: torch.dtype, num_tokens: int,
                                                        hidden_size: int) -> None:
    x = _randn(num_tokens, hidden_size + 8, dtype=dtype, seed=hidden_size)[:, :hidden_size]
    x[0] = 0  # a zero row: scale 1, values 0
    weight = _randn(hidden_size, dtype=dtype, seed=1)
    quantized = rms_norm(x, weight, EPS, quantize=True)
    _assert_quantizes(quantized, rms_norm(x, weight, EPS))
    assert torch.equal(quantized.scales[0], torch.ones_like(quantized.scales[0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden_size", [(1, 200), (4, 256)])
def test_add_and_norm_quantized_updates_the_residual_and_leaves_x(
        dtype: torch.dtype, num_tokens: int, hidden_size: int) -> None:
    x = _randn(num_tokens, hidden_size, dtype=dtype, seed=2)
    residual = _randn(num_tokens, hidden_size, dtype=dtype, seed=3)
    weight = _randn(hidden_size, dtype=dtype, seed=4)
    dense, dense_residual = fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS)
    x_in, residual_in = x.clone(), residual.clone()
    quantized, new_residual = fused_add_rms_norm(x_in, residual_in, weight, EPS, quantize=True)
    assert new_residual is residual_in and torch.equal(new_residual, dense_residual)
    assert torch.equal(x_in, x)  # the normed rows go to the quantized output only
    _assert_quantizes(quantized, dense)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,inter", [(1, 64), (3, 200), (2, 1100)])
def test_silu_and_mul_quantized_is_the_activation_then_quantized(
        dtype: torch.dtype, num_tokens: int, inter: int) -> None:
    gate_up = _randn(num_tokens, 2 * inter + 8, dtype=dtype, seed=inter)[:, : 2 * inter]
    quantized = silu_and_mul(gate_up, quantize=True)  # 1100: two column blocks of 8 groups
    _assert_quantizes(quantized, silu_and_mul(gate_up))


def test_linear_reads_quantized_activations_as_their_dequantized_values() -> None:
    """On the CPU an FP8 Linear given quantized activations computes in float32 with them and
    the weight dequantized (the w8a8 product's oracle), and adds the bias."""
    gen = torch.Generator().manual_seed(0)
    weight, weight_scales = quantize_block_fp8(torch.randn(40, 200, generator=gen) * 0.05)
    values, scales = quantize_block_fp8(torch.randn(3, 200, generator=gen), (1, 128))
    x = QuantizedActivations(values, scales, torch.float32)
    bias = torch.randn(40, generator=gen)
    want = (dequantize_block_fp8(values, scales, block_size=(1, 128))
            @ dequantize_block_fp8(weight, weight_scales).T + bias)
    torch.testing.assert_close(linear(x, weight, bias, weight_scales), want, rtol=1e-6,
                               atol=1e-6)


def test_padded_rows_are_zero_with_scale_one() -> None:
    values, scales = quantize_block_fp8(torch.randn(5, 200), (1, 128))
    padded = QuantizedActivations(values, scales, torch.bfloat16).padded_rows(4)
    assert padded.shape == (8, 200) and padded.dtype == torch.bfloat16
    assert padded.values.dtype == FP8_DTYPE and padded.scales.stride() == (1, 8)
    assert torch.equal(padded.values[:5].float(), values.float())
    assert torch.equal(padded.scales[:5], scales)
    assert not padded.values[5:].float().any() and torch.equal(
        padded.scales[5:], torch.ones(3, 2))
