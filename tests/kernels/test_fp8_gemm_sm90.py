"""The warp-specialised sm_90 block-FP8 GEMM (`kernels/fp8_gemm_sm90.py`): without a GPU it
compiles for sm_90 with no spills inside the shared memory its launcher assumes, as one FP8
wgmma chain per K block fed and drained by TMA; `product_path` takes it only where it is turned
on and TMA takes the shape. On an sm_90 GPU it matches the float32 product of the same
dequantized operands element by element, partial tiles and the persistent loop included."""

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from mlaserve.kernels import fp8_gemm  # noqa: E402
from mlaserve.kernels.fp8_activations import quantize_activations  # noqa: E402
from mlaserve.kernels.fp8_blocks import empty_quantized, quantize_block_fp8  # noqa: E402
from mlaserve.kernels.fp8_gemm import (  # noqa: E402
    block_fp8_linear,
    block_fp8_reference,
    product_path,
)
from mlaserve.kernels.fp8_gemm_sm90 import (  # noqa: E402
    block_fp8_matmul_sm90,
    choose_block_n,
    choose_k_splits,
    gluon_gemm_serves,
    shared_memory_bytes,
    tma_ready_scales,
)
from mlaserve.kernels.mla_decode.common import GLUON_SHARED_MEMORY_LIMIT  # noqa: E402
from tests.kernels.sm90_compile import compile_sm90  # noqa: E402

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("num_stages,k_unroll,block_n,out_dtype", [
    (4, 1, 128, "bfloat16"), (5, 4, 128, "bfloat16"), (3, 2, 128, "float16"),
    (7, 4, 64, "bfloat16"),
    (5, 2, 128, "float32"),  # the partial sums of a split K, the default ring
])
def test_compiles_for_sm90_without_spills(num_stages: int, k_unroll: int, block_n: int,
                                          out_dtype: str) -> None:
    result = compile_sm90("compile_for_sm90", module="mlaserve.kernels.fp8_gemm_sm90",
                          num_stages=num_stages, k_unroll=k_unroll, block_n=block_n,
                          out_dtype=out_dtype)
    assert result["stack"] == 0  # no register spills
    shared = shared_memory_bytes(num_stages, getattr(torch, out_dtype), block_n)
    assert result["shared"] <= shared <= GLUON_SHARED_MEMORY_LIMIT
    # ptxas keeps the products asynchronous (it serialises every wgmma, with a note, when
    # registers run short or accumulators in flight are copied)
    assert "serialized" not in result["ptxas_notes"]
    ptx = result["ptx"]
    # each K block is one chain of four k32 FP8 wgmmas with no promotion of its own (the
    # kernel scales the block's sum itself): per warpgroup, K_UNROLL chains in the unrolled
    # loop and one for the remaining blocks
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{block_n}k32.f32.e4m3.e4m3"
    assert ptx.count(wgmma) == 2 * 4 * (k_unroll + (k_unroll > 1))
    assert ptx.count("wgmma.mma_async") == ptx.count(wgmma)
    assert ("wgmma.wait_group.sync.aligned 1" in ptx) == (k_unroll > 1)  # two in flight
    # x, W and x's scales by TMA; from global memory only the weight's scale of each block
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier") == 3
    assert ptx.count("ld.global") == 2 * (k_unroll + (k_unroll > 1))
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group") == 2  # y
    assert "setmaxnreg" in ptx  # warp-specialised register split


def test_product_path_takes_the_gluon_kernel_for_narrow_products(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Gluon kernel's 64-wide tiles fill the SMs and cuBLASLt's do not: V3's fused
    q_a + kv_a (N 2112) from 64 to 1024 tokens, a routed expert's gate_up (N 4096) to 256;
    and wherever cuBLASLt refuses the shape."""
    v3_fused_qkv_a, v3_expert_gate_up, v3_gate_up = (2112, 7168), (4096, 7168), (36864, 7168)
    for rows in (64, 256, 1024):
        assert product_path(True, rows, *v3_fused_qkv_a, sm90=True) == "gluon"
    assert product_path(True, 4096, *v3_fused_qkv_a, sm90=True) == "cublas"  # 128-wide tiles
    assert product_path(True, 16, *v3_fused_qkv_a, sm90=True) == "weight-only"
    assert product_path(True, 17, *v3_fused_qkv_a, sm90=True) == "cublas"  # < GLUON_MIN_ROWS
    assert product_path(True, 256, *v3_expert_gate_up, sm90=True) == "gluon"
    assert product_path(True, 1024, *v3_expert_gate_up, sm90=True) == "cublas"
    assert product_path(True, 1024, *v3_gate_up, sm90=True) == "cublas"  # wide
    assert product_path(True, 1024, *v3_fused_qkv_a, sm90=False) == "cublas"  # not sm_90
    # on a GPU of fewer SMs, 136 wide tiles fill the rounds better
    assert product_path(True, 1024, *v3_fused_qkv_a, sm90=True, num_sms=68) == "cublas"
    assert product_path(True, 1024, 1000, 300, sm90=True) == "triton"  # K not a multiple of 16
    # shapes cuBLASLt refuses (K not a multiple of 512) take it at any row count on sm_90:
    # V2-Lite's dense down_proj, and a V2-Lite expert's down_proj outside the fused MoE
    v2_lite_down, v2_lite_expert_down = (2048, 10944), (2048, 1408)
    for rows in (17, 64, 1024, 8192):
        assert product_path(True, rows, *v2_lite_down, sm90=True) == "gluon"
        assert product_path(True, rows, *v2_lite_down, sm90=False) == "triton"
    assert product_path(True, 16, *v2_lite_down, sm90=True) == "weight-only"
    assert product_path(True, 1024, *v2_lite_expert_down, sm90=True) == "gluon"
    assert product_path(False, 1024, *v3_fused_qkv_a, sm90=True) == "triton"
    monkeypatch.setattr(fp8_gemm, "GLUON_MIN_ROWS", 0)
    assert product_path(True, 1024, *v3_fused_qkv_a, sm90=True) == "cublas"
    assert not gluon_gemm_serves(0, 128, 128) and not gluon_gemm_serves(8, 1001, 128)


def test_narrow_tiles_where_wide_ones_leave_the_last_round_mostly_empty() -> None:
    # V3's fused q_a + kv_a (N 2112) at 1024 tokens: 136 wide tiles on 132 SMs are two rounds
    # of nearly nothing in the second; 264 narrow ones are two rounds of half the work (on
    # the H200: 39 us narrow against 47 wide)
    assert choose_block_n(1024, 2112, 132) == 64
    # 544 wide: 5 rounds; 1056 narrow: 8, each 0.8 of a wide one (124 us wide against 150)
    assert choose_block_n(4096, 2112, 132) == 128
    assert choose_block_n(8192, 2112, 132) == 128  # 1088 wide: 9 rounds; narrow: 16
    assert choose_block_n(1024, 7168, 132) == 128  # 448 wide: 4 rounds; 896 narrow: 7
    assert choose_block_n(4096, 36864, 132) == 128  # many rounds either way
    assert choose_block_n(1024, 4096, 132) == 128  # 256 wide: 2 full rounds; 512 narrow: 4
    assert choose_block_n(1, 256, 132) == 64  # one round either way: narrow tiles, more SMs


def test_k_split_only_where_the_tiles_leave_most_sms_idle() -> None:
    # V3's fused q_a + kv_a (K 7168: 56 K blocks) in narrow tiles: 33 at 64 tokens fill 132
    # SMs in 4 runs of 14 K blocks; 66 at 256 in 2; 264 at 1024 need none
    assert choose_k_splits(64, 2112, 7168, 64, 132) == 4
    assert choose_k_splits(256, 2112, 7168, 64, 132) == 2
    assert choose_k_splits(1024, 2112, 7168, 64, 132) == 1
    assert choose_k_splits(64, 2112, 7168, 128, 132) == 7  # 17 wide tiles, 8 K blocks a run
    assert choose_k_splits(64, 4096, 7168, 64, 132) == 2  # a routed expert's gate_up
    assert choose_k_splits(64, 4096, 7168, 64, 100) == 1  # its 64 tiles fill most of 100 SMs
    assert choose_k_splits(64, 2112, 512, 64, 132) == 1  # 4 K blocks: too few to split
    assert choose_k_splits(1, 128, 1024, 128, 132) == 2  # one tile: runs of 4 of its 8 blocks


@pytest.mark.parametrize("rows", [1, 37, 64])
def test_scales_reach_tma_m_major_with_16_byte_columns(rows: int) -> None:
    # the kernel copies x's scales of a K block [1, 128] by TMA from the scales seen K-major:
    # unit row stride, a column stride of a multiple of 4 floats; scales already so pass as
    # they are, others are copied (M-major of any M, as the producers write them, or K-major)
    m_major = torch.empty_strided((rows, 3), (1, rows)).copy_(torch.randn(rows, 3))
    for scales in (m_major, m_major.contiguous()):
        ready = tma_ready_scales(scales)
        assert ready.stride(0) == 1 and ready.stride(1) % 4 == 0
        assert ready.data_ptr() % 16 == 0 and torch.equal(ready, scales)
    written = empty_quantized(rows, 300, torch.bfloat16, torch.device("cpu")).scales
    assert tma_ready_scales(written) is written  # as the quantizing kernels write them
    assert (tma_ready_scales(m_major) is m_major) == (rows % 4 == 0)


def test_refuses_what_it_cannot_run() -> None:
    weight, scale_inv = quantize_block_fp8(torch.randn(256, 256))
    x_q, x_scales = quantize_activations(torch.randn(4, 256))
    with pytest.raises(ValueError, match="sm_90 GPUs only"):
        block_fp8_matmul_sm90(x_q, x_scales, weight, scale_inv, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        block_fp8_matmul_sm90(x_q, x_scales, weight, scale_inv, torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        block_fp8_matmul_sm90(x_q.float(), x_scales, weight, scale_inv, torch.bfloat16)
    with pytest.raises(ValueError, match="block_n must be one of"):
        block_fp8_matmul_sm90(x_q, x_scales, weight, scale_inv, torch.bfloat16, block_n=96)
    with pytest.raises(ValueError, match="k_splits must be 1 or more"):
        block_fp8_matmul_sm90(x_q, x_scales, weight, scale_inv, torch.bfloat16, k_splits=0)
    with pytest.raises(ValueError, match="x_scales must be float32"):
        block_fp8_matmul_sm90(x_q, x_scales[:, :1], weight, scale_inv, torch.bfloat16)
    with pytest.raises(ValueError, match="columns"):
        block_fp8_matmul_sm90(x_q, x_scales, weight[:, :128], scale_inv[:, :1], torch.bfloat16)


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Element by element: the output's rounding (2^-8 relative for bf16 and far less for
    fp16) plus the FP8 tensor cores' reduced-precision sum of each 128-deep block (1e-3 of
    the output's rms; 1.3e-4 relative measured on the H200). One K block's scale off by 2x
    moves elements by about rms / sqrt(K blocks), at least 0.13 rms here."""
    bound = 2**-8 * want.abs() + 1e-3 * want.pow(2).mean().sqrt()
    excess = ((got.float() - want).abs() - bound).max().item()
    assert excess <= 0, f"off by {excess:.3g} beyond the bound"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the Gluon GEMM runs on sm_90 GPUs")
@pytest.mark.parametrize("rows,out_features,in_features", [
    (1, 128, 128),
    (37, 520, 320),  # partial row, column and K tiles
    (129, 256, 512),  # one row into a second row tile
    (64, 2112, 7168),  # V3's fused q_a + kv_a at 64 tokens (`choose_k_splits`: 4 runs)
    (300, 2112, 7168),  # V3's fused q_a + kv_a: 56 K blocks, a half column tile
    (1024, 2112, 7168),  # the same at 1024 tokens: narrow tiles by default
    (1024, 4096, 1536),  # 256 tiles: the persistent loop, two tiles and more per CTA
])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_matches_the_dequantized_product(rows: int, out_features: int, in_features: int,
                                         out_dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=gen, device="cuda", dtype=torch.bfloat16)
    weight, scale_inv = quantize_block_fp8(
        torch.randn(out_features, in_features, generator=gen, device="cuda") * 0.05)
    x_q, x_scales = quantize_activations(x)
    want = block_fp8_reference(x_q, x_scales, weight, scale_inv)  # [M, N] float32
    got = block_fp8_matmul_sm90(x_q, x_scales, weight, scale_inv, out_dtype)
    assert got.shape == (rows, out_features) and got.dtype == out_dtype
    _assert_matches(got, want)
    # K split as `choose_k_splits` would, in runs that leave a last short one (3 of 56 blocks:
    # 19, 19, 18) or one K block each (more runs than blocks), with the persistent loop taking
    # several units per CTA
    chosen_splits = choose_k_splits(rows, out_features, in_features, 64, 132)
    for stages, group_m, k_unroll, block_n, k_splits in (
            (2, 1, 1, 128, 1), (4, 16, 2, 128, 1), (2, 1, 1, 64, 1), (7, 8, 4, 64, 1),
            (5, 8, 2, 64, chosen_splits), (5, 8, 2, 128, 3), (4, 8, 4, 64, 64)):
        _assert_matches(block_fp8_matmul_sm90(x_q, x_scales, weight, scale_inv, out_dtype,
                                              num_stages=stages, group_m=group_m,
                                              k_unroll=k_unroll, block_n=block_n,
                                              k_splits=k_splits), want)
    wrong = x_scales.clone()
    wrong[:, -1] *= 2  # the bound catches one K block scaled wrong
    with pytest.raises(AssertionError, match="beyond the bound"):
        _assert_matches(block_fp8_reference(x_q, wrong, weight, scale_inv), want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the Gluon GEMM runs on sm_90 GPUs")
def test_linear_runs_it_when_turned_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_gemm, "GLUON_MIN_ROWS", 64)
    x = torch.randn(2, 100, 1536, device="cuda", dtype=torch.bfloat16)
    weight, scale_inv = quantize_block_fp8(torch.randn(1024, 1536, device="cuda") * 0.05)
    y = block_fp8_linear(x, weight, scale_inv)
    x_q, x_scales = quantize_activations(x.view(200, 1536))
    assert y.shape == (2, 100, 1024) and y.dtype == torch.bfloat16
    _assert_matches(y.view(200, 1024), block_fp8_reference(x_q, x_scales, weight, scale_inv))
    # a shape cuBLASLt refuses (11 K blocks, as a V2-Lite expert's down_proj) at a row count
    # below GLUON_MIN_ROWS
    x = torch.randn(40, 1408, device="cuda", dtype=torch.bfloat16)
    weight, scale_inv = quantize_block_fp8(torch.randn(2048, 1408, device="cuda") * 0.05)
    assert fp8_gemm.linear_product_path(x, weight) == "gluon"
    x_q, x_scales = quantize_activations(x)
    _assert_matches(block_fp8_linear(x, weight, scale_inv),
                    block_fp8_reference(x_q, x_scales, weight, scale_inv))
