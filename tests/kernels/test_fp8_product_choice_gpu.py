"""The measured block-FP8 product table on a GPU: every choice is a candidate that runs, a
Linear that obeys the installed table gives the float32 product of its operands within the FP8
product's bound in every row bucket (one dropped 128-column K block fails it), and a model's
load measures its shapes once and installs them."""

import pytest
import torch

from mlaserve.bench.gemm import BF16_ROUNDING, FP8_MMA_REL_ERR, WEIGHT_ONLY_REL_ERR
from mlaserve.kernels import fp8_product_choice, fp8_product_table
from mlaserve.kernels.fp8_activations import quantize_activations
from mlaserve.kernels.fp8_blocks import (
    QuantizedActivations,
    dequantize_block_fp8,
    quantize_block_fp8,
)
from mlaserve.kernels.fp8_gemm import block_fp8_linear, block_fp8_reference, linear_product_path
from mlaserve.kernels.fp8_gemm_common import is_sm90
from mlaserve.kernels.fp8_gemm_deepgemm import load_deep_gemm
from mlaserve.kernels.fp8_product_table import ROW_BUCKETS
from mlaserve.kernels.testing import relative_error

pytestmark = pytest.mark.gpu
SHAPES = [(3648, 2048), (2048, 2048)]  # V2-Lite's q + kv_a and o_proj


@pytest.fixture(autouse=True)
def no_table():
    fp8_product_table.uninstall()
    yield
    fp8_product_table.uninstall()


@pytest.fixture(scope="module")
def table():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return fp8_product_choice.measure(SHAPES, torch.device("cuda"), repeats=3)


def test_every_choice_is_a_candidate_of_its_bucket(table) -> None:
    sm90, deep_gemm = is_sm90(torch.device("cuda")), load_deep_gemm() is not None
    for shape in SHAPES:
        buckets = table.paths[shape]
        assert [rows for rows, _ in buckets] == list(ROW_BUCKETS)
        for rows, path in buckets:
            assert path in fp8_product_choice.candidate_paths(rows, *shape, sm90=sm90,
                                                              deep_gemm=deep_gemm)


@pytest.mark.parametrize("rows", [1, 5, 16, 100, 1024, 3000])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_linear_obeying_the_table_gives_the_float32_product(table, rows, shape) -> None:
    fp8_product_table.install(table)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, shape[1], device="cuda", generator=gen).to(torch.bfloat16)
    w_fp8, w_scales = quantize_block_fp8(
        torch.randn(*shape, device="cuda", generator=gen) * 0.02)
    path = linear_product_path(x, w_fp8)
    assert path == table.path(rows, *shape)
    if path == "weight-only":  # x as it is against the dequantized weight
        want, gate = x.float() @ dequantize_block_fp8(w_fp8, w_scales).T, WEIGHT_ONLY_REL_ERR
        x_in = x
    else:  # the producer's quantized x, as the model hands it
        x_q, x_scales = quantize_activations(x)
        want = block_fp8_reference(x_q, x_scales, w_fp8, w_scales)
        gate = FP8_MMA_REL_ERR + BF16_ROUNDING
        x_in = QuantizedActivations(x_q, x_scales, x.dtype)
    got = block_fp8_linear(x_in, w_fp8, w_scales)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    assert relative_error(got.float(), want) <= gate, path
    dropped = w_fp8.clone()
    dropped[:, 128:256] = 0
    assert relative_error(block_fp8_linear(x_in, dropped, w_scales).float(), want) > 5 * gate


def test_a_model_load_measures_its_shapes_once_and_installs_them(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mlaserve.config import ModelConfig
    from mlaserve.model.fp8_linear import product_shapes
    from mlaserve.model.loader import build_model

    monkeypatch.setenv(fp8_product_choice.CACHE_ENV, str(tmp_path))
    config = ModelConfig.from_dict(dict(
        model_type="deepseek_v2", vocab_size=512, hidden_size=1024, intermediate_size=2048,
        moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=256, torch_dtype="bfloat16"))
    model = build_model(config, None, device=torch.device("cuda"), dtype=torch.bfloat16,
                        load_format="dummy", max_positions=256, quantization="fp8")
    shapes = product_shapes(model)
    installed = fp8_product_table.installed()
    assert shapes and installed is not None and set(installed.paths) >= shapes
    (cached,) = tmp_path.rglob("*.json")
    fp8_product_table.uninstall()
    measured = []
    monkeypatch.setattr(fp8_product_choice, "measure",
                        lambda *args, **kwargs: measured.append(args))
    build_model(config, None, device=torch.device("cuda"), dtype=torch.bfloat16,
                load_format="dummy", max_positions=256, quantization="fp8")
    assert not measured and fp8_product_table.installed().paths == installed.paths
    assert cached.exists()
