"""Block-FP8 GEMM (w8a8, 1x128 activation and 128x128 weight scales) against the float32
product of the same dequantized operands; Triton's interpreter on CPU, the GPU where present."""

import pytest
import torch

from mlaserve.bench.gemm import FP8_MMA_REL_ERR
from mlaserve.kernels.fp8_activations import quantize_activations
from mlaserve.kernels.fp8_blocks import FP8_MAX, quantize_block_fp8
from mlaserve.kernels.fp8_gemm import (
    block_fp8_linear,
    block_fp8_matmul,
    block_fp8_reference,
    sum_splits,
)
from mlaserve.kernels.testing import relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_activation_groups_quantize_per_token_and_128_columns() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 300, generator=gen) * torch.tensor([1.0, 10.0, 0.0])[:, None]
    x[0, 130] = 40.0  # one large value rescales only its own group
    x_q, scales = quantize_activations(x)
    assert x_q.dtype == torch.float8_e4m3fn and scales.shape == (3, 3)
    assert scales[0, 1] == pytest.approx(40.0 / FP8_MAX) and scales[0, 0] < scales[0, 1] / 5
    assert torch.all(scales[2] == 1.0)  # all-zero rows
    per_element = scales.repeat_interleave(128, dim=1)[:, :300]  # [3, 300]
    back = x_q.float() * per_element
    # e4m3 rounds to 3 mantissa bits (half a step: 2^-4 relative), and below 2^-6 to the
    # subnormal step 2^-9 (half a step: 2^-10 of the scale)
    bound = torch.maximum(x.abs() * 2**-4, per_element * 2**-10)
    assert torch.all((back - x).abs() <= bound)


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 128, 128), (5, 200, 300),
                                                           (33, 256, 512)])
def test_matches_the_dequantized_product(rows: int, out_features: int, in_features: int) -> None:
    """Exact up to float32 rounding against the product of the dequantized operands, partial
    scale blocks included; far from it if one K block's scale is dropped."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight, scale_inv = quantize_block_fp8(torch.randn(out_features, in_features,
                                                       generator=gen) * 0.05)
    x_q, x_scales = quantize_activations(x)
    want = block_fp8_reference(x_q, x_scales, weight, scale_inv)
    got = block_fp8_matmul(x_q.to(DEVICE), x_scales.to(DEVICE), weight.to(DEVICE),
                           scale_inv.to(DEVICE), torch.float32).cpu()
    assert got.shape == (rows, out_features)
    # float32 rounding in the interpreter; on a GPU, from 32 rows on (wgmma), Hopper's FP8
    # tensor cores add each 128-deep block in reduced precision (the H200: 1e-4 relative)
    bound = FP8_MMA_REL_ERR if DEVICE == "cuda" else 1e-6
    assert relative_error(got, want) <= bound
    if in_features > 128:  # the bound would catch a kernel that ignored one block's scale
        wrong = x_scales.clone()
        wrong[:, -1] *= 2
        assert relative_error(got, block_fp8_reference(x_q, wrong, weight, scale_inv)) > 10 * bound


def test_linear_keeps_leading_dims_and_dtype() -> None:
    x = torch.randn(2, 3, 256)
    weight, scale_inv = quantize_block_fp8(torch.randn(128, 256) * 0.05)
    y = block_fp8_linear(x.to(DEVICE), weight.to(DEVICE), scale_inv.to(DEVICE)).cpu()
    assert y.shape == (2, 3, 128) and y.dtype == x.dtype
    exact = x @ (weight.float() * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)).T
    assert (y - exact).norm() / exact.norm() < 0.1  # activation quantization error only


def test_split_sums_add_the_first_rows_of_each_slab() -> None:
    """A split product's second launch: slabs of 8 rows (a tile's rows rounded up) for a y of
    6; the rows past y in each slab are left out, whatever they hold."""
    partial = torch.randn(3, 8, 40, device=DEVICE)
    partial[:, 6:] = float("nan")
    y = torch.empty(6, 40, device=DEVICE, dtype=torch.float16)
    sum_splits(partial, y)
    torch.testing.assert_close(y.float(), partial[:, :6].sum(0), rtol=1e-3, atol=1e-3)


def test_refuses_mismatched_scales() -> None:
    weight, scale_inv = quantize_block_fp8(torch.randn(256, 256))
    x_q, x_scales = quantize_activations(torch.randn(2, 256))
    with pytest.raises(ValueError, match="does not cover"):
        block_fp8_matmul(x_q, x_scales, weight, scale_inv[:1], torch.float32)


def test_bench_gemm_shapes_and_cpu_refusal(capsys) -> None:
    """`mlaserve bench gemm` times the FP8 GEMMs of DeepSeek-V3 (one rank) as the model runs
    them (q_a and kv_a fused, kv_b_proj not at all: it is bf16 after loading), and says on a
    CPU-only machine that it needs a GPU."""
    from mlaserve.bench.gemm import load_config, projections
    from mlaserve.cli import main

    v3 = projections(load_config("deepseek-v3"))
    shapes = {p.name: (p.out_features, p.in_features) for p in v3}
    assert shapes["q_a+kv_a_proj"] == (1536 + 576, 7168) and "kv_b_proj" not in shapes
    assert shapes["q_b_proj"] == (128 * 192, 1536) and shapes["o_proj"] == (7168, 16384)
    assert shapes["expert.gate_up_proj"] == (4096, 7168) and shapes["mlp.down_proj"][1] == 18432
    lite = {p.name: p.out_features for p in projections(load_config("deepseek-v2-lite"))}
    assert lite["q+kv_a_proj"] == 16 * 192 + 576  # V2-Lite has no q_lora
    quantized_by_producer = {p.name for p in v3 if p.producer_quantizes}
    assert quantized_by_producer == {"q_a+kv_a_proj", "q_b_proj", "mlp.gate_up_proj",
                                     "mlp.down_proj"}  # o_proj's input is attention's output
    if not torch.cuda.is_available():
        assert main(["bench", "gemm"]) == 2
        assert "it needs a CUDA GPU" in capsys.readouterr().err


def test_bench_gemm_counts_the_cells_under_each_bar() -> None:
    """The summary counts a layer under 0.97x the fastest library product at any row count,
    under bf16 from 16 tokens only, and leaves cells without a library product out."""
    from mlaserve.bench.gemm import bar_summary

    def row(tokens: int, library: float, bf16: float) -> dict:
        return dict(model="m", name=f"p{tokens}", tokens=tokens, layer_vs_library=library,
                    layer_vs_bf16=bf16)

    summary = bar_summary([row(1, 0.96, 0.5), row(16, 0.98, 0.99), row(64, float("nan"), 1.2),
                           row(1024, 1.3, 1.5)])
    lines = summary.splitlines()
    assert lines[0].startswith("layer >= 0.97 x fastest library product: 2 of 3 cells")
    assert "m p1 M=1 (0.96 lib, 0.50 bf16)" in lines[0] and "p16" not in lines[0]
    assert lines[1].startswith("layer >= bf16 from 16 tokens: 2 of 3 cells")
    assert "m p16 M=16" in lines[1] and "p1 " not in lines[1]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(1, 7168), (37, 300), (512, 1536)])
def test_cuda_quantization_kernel_equals_the_torch_quantizer(rows: int, cols: int) -> None:
    """The Triton per-token-group quantizer (CUDA) against `quantize_block_fp8` with 1x128
    blocks: the same scales, and FP8 values equal but for ties rounded the other way."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.bfloat16) * 3
    x[0, :128] = 0.0  # an all-zero group: scale 1
    x_q, scales = quantize_activations(x)
    want_q, want_scales = quantize_block_fp8(x, (1, 128))
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    differs = (x_q.float() != want_q.float()).float().mean().item()
    assert differs < 1e-3
