"""The weight-only block-FP8 product (w8a16, `fp8_weight_only_matmul`) against the float32
product of x with the dequantized weight, and the choice of `block_fp8_linear`'s product.

Without a CUDA GPU the kernel runs in Triton's CPU interpreter (conftest.py sets
TRITON_INTERPRET=1), in float32 and float16 (the interpreter's bfloat16 dot is not faithful);
with one it runs natively, in bfloat16 too. Every shape has ragged edges: N (40, 200) is no
multiple of the 16-column tile the kernel picks for them, K = 200 ends in a partial 128-block,
and so does N = 200 (N = 40 is one partial block).
"""

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from mlaserve.kernels import fp8_gemm  # noqa: E402
from mlaserve.kernels.fp8_blocks import dequantize_block_fp8, quantize_block_fp8  # noqa: E402
from mlaserve.kernels.fp8_gemm import (  # noqa: E402
    fp8_weight_only_matmul,
    product_path,
    weight_only_tiles,
)

pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or TRITON_INTERPRET=1")

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# max |y - reference| / max |reference|: float32 rounding of the sums (the interpreter shows
# 4e-7), else the output dtype's rounding (float16: 4e-4 in the interpreter; bfloat16's half
# step is 2^-9 relative).
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _error(y: torch.Tensor, want: torch.Tensor) -> float:
    return float((y.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("swap_ab", [False, True], ids=["xWt", "Wxt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("out_features,in_features", [(40, 200), (40, 384), (200, 200),
                                                      (200, 384)])
def test_matches_the_dequantized_product(dtype: torch.dtype, rows: int, out_features: int,
                                         in_features: int, swap_ab: bool) -> None:
    """Equal, up to float32 sums and the output's rounding, to x.float() @ dequant(W)^T; far
    from it if one scale block (the last, partial one where N or K is ragged) were 2x off.
    At 5 rows x and the weight are views into NaN-padded rows, so a read past K shows. Both
    operand orders (x W^T, and W x^T stored transposed) give it."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight, scale_inv = quantize_block_fp8(torch.randn(out_features, in_features,
                                                       generator=gen) * 0.05)
    scale_inv *= 1 + torch.rand(scale_inv.shape, generator=gen)  # a distinct scale per block
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    want = x.float() @ dequantize_block_fp8(weight, scale_inv).T  # [M, N]
    x_in, weight_in = x.to(DEVICE), weight.to(DEVICE)
    if rows == 5:
        x_in = torch.nn.functional.pad(x_in, (3, 16), value=float("nan"))[:, 3:-16]  # [M, K]
        weight_in = torch.nn.functional.pad(weight_in.float(), (0, 16), value=float("nan")).to(
            weight.dtype)[:, :in_features]  # [N, K] view, exact: FP8 values are float32's
        assert weight_in.stride(0) == in_features + 16
    y = fp8_weight_only_matmul(x_in, weight_in, scale_inv.to(DEVICE), swap_ab=swap_ab).cpu()
    assert y.shape == (rows, out_features) and y.dtype == dtype
    assert _error(y, want) <= TOLERANCES[dtype]
    wrong = scale_inv.clone()
    wrong[-1, -1] *= 2
    assert _error(y, x.float() @ dequantize_block_fp8(weight, wrong).T) > 10 * TOLERANCES[dtype]


@pytest.mark.parametrize("block_n,k_blocks,k_splits,swap_ab",
                         [(16, 1, 1, False), (32, 2, 1, False), (64, 1, 1, False),
                          (16, 4, 1, False), (64, 1, 2, False), (32, 2, 3, False),
                          (64, 1, 5, False), (16, 2, 9, False), (64, 2, 3, True),
                          (32, 1, 9, True), (128, 1, 2, True), (128, 2, 1, False)])
def test_every_tiling_gives_the_same_product(block_n: int, k_blocks: int, k_splits: int,
                                             swap_ab: bool) -> None:
    """The tuning knobs change the tiling, not the result (float32, N = 200 ragged at every
    width; K = 640 is 5 blocks, so 2 and 4 blocks a step end in a step past the last block;
    3 splits are of 2, 2 and 1 blocks, 9 become 5 of one; 20 rows are ragged in 32-row
    blocks)."""
    gen = torch.Generator().manual_seed(block_n)
    weight, scale_inv = quantize_block_fp8(torch.randn(200, 640, generator=gen) * 0.05)
    scale_inv *= 1 + torch.rand(scale_inv.shape, generator=gen)  # a distinct scale per block
    x = torch.randn(20, 640, generator=gen)
    want = x @ dequantize_block_fp8(weight, scale_inv).T
    y = fp8_weight_only_matmul(x.to(DEVICE), weight.to(DEVICE), scale_inv.to(DEVICE),
                               block_n=block_n, k_blocks=k_blocks, k_splits=k_splits,
                               num_stages=3, num_warps=2, swap_ab=swap_ab).cpu()
    assert _error(y, want) <= TOLERANCES[torch.float32]


def test_refuses_bad_operands() -> None:
    weight, scale_inv = quantize_block_fp8(torch.randn(256, 256))
    with pytest.raises(ValueError, match="does not cover"):
        fp8_weight_only_matmul(torch.randn(2, 256), weight, scale_inv[:1])
    with pytest.raises(ValueError, match="k_blocks must be 1, 2, 4 or 8"):
        fp8_weight_only_matmul(torch.randn(2, 256), weight, scale_inv, k_blocks=3)
    with pytest.raises(ValueError, match="block_n"):
        fp8_weight_only_matmul(torch.randn(2, 256), weight, scale_inv, block_n=256)
    with pytest.raises(ValueError, match="k_splits must be 1 or more"):
        fp8_weight_only_matmul(torch.randn(2, 256), weight, scale_inv, k_splits=0)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        fp8_weight_only_matmul(torch.randn(2, 256, dtype=torch.float64), weight, scale_inv)


def test_product_path_and_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a few rows take the weight-only product where the weight is small enough,
    more rows cuBLASLt where it takes the shape, else the Triton w8a8 kernel; the CPU always
    the Triton kernel."""
    v3_fused_qkv_a = (2112, 7168)  # q_a_proj and kv_a_proj_with_mqa, N x K
    v3_o_proj = (7168, 16384)  # 117 MB in FP8
    monkeypatch.setattr(fp8_gemm, "WEIGHT_ONLY_MAX_ROWS", 16)
    assert product_path(True, 1, *v3_fused_qkv_a) == "weight-only"
    assert product_path(True, 16, *v3_fused_qkv_a) == "weight-only"
    assert product_path(True, 17, *v3_fused_qkv_a) == "cublas"
    assert product_path(True, 1, *v3_o_proj) == "cublas"  # past WEIGHT_ONLY_MAX_WEIGHT_BYTES
    assert product_path(True, 0, *v3_fused_qkv_a) == "cublas"
    assert product_path(True, 1000, 200, 300) == "triton"  # K not a multiple of 512
    assert product_path(False, 1, *v3_fused_qkv_a) == "triton"
    assert product_path(False, 6, *v3_fused_qkv_a) == "triton"  # 2 x 3 rows off CUDA
    monkeypatch.setattr(fp8_gemm, "WEIGHT_ONLY_MAX_ROWS", 0)
    assert product_path(True, 1, *v3_fused_qkv_a) == "cublas"
    # K split in up to 4 runs of at least 14 K blocks: V3's fused q_a + kv_a (K 7168) in 4
    assert weight_only_tiles(1, 2112, 7168) == (16, 32, 4)
    assert weight_only_tiles(16, 24576, 1536) == (16, 32, 1)  # 12 K blocks: no split
    assert weight_only_tiles(33, 7168, 2048) == (64, 32, 1)  # 16 K blocks: no split
    assert weight_only_tiles(100, 7168, 4096) == (64, 32, 2)
    assert weight_only_tiles(1, 7168, 16384) == (16, 32, 4)  # 128 K blocks: at most 4
