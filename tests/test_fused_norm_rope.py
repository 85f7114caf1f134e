"""The fused norm / rope / latent-write kernels against their float32 references, the norms and
SiLU-and-mul quantizing their output for a w8a8 product (`quantize=True`) against their own
output quantized per token and 128 columns in torch, and the whole model with the kernels
forced on against its torch path (with block-FP8 Linears too, whose inputs the forced kernels
then quantize).

Without a CUDA GPU the kernels run in Triton's CPU interpreter (small shapes, float32 and
float16: the interpreter's bfloat16 is not faithful); with one they run natively, in bfloat16
too. Widths that are not powers of two exercise the masks; destinations are views into larger
NaN-filled tensors, so a kernel that writes outside its rows or columns is caught. The
interpreter's float32 -> FP8 conversion is wrong (`fp8_activations`): there quantized values are
stored in float32, unrounded, and compared with the torch quotient exactly; on a GPU their FP8
bits must equal torch's rounding of that quotient.
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from mlaserve.attention.base import MLABackend, MLAShape  # noqa: E402
from mlaserve.attention.metadata import AttentionMetadata, PrefillChunk  # noqa: E402
from mlaserve.attention.registry import create_backend  # noqa: E402
from mlaserve.config import FP8_QUANTIZATION_CONFIG, ModelConfig, YarnScaling  # noqa: E402
from mlaserve.kernels import fused_norm_rope  # noqa: E402
from mlaserve.kernels.fp8_blocks import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    QuantizedActivations,
    QuantizedWithRows,
    scales_column_stride,
)
from mlaserve.kernels.fused import force_fused_kernels  # noqa: E402
from mlaserve.kernels.fused_norm_rope import (  # noqa: E402
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_latent,
)
from mlaserve.kernels.reference import (  # noqa: E402
    latent_rows_reference,
    rms_norm_reference,
    rope_reference,
)
from mlaserve.model.layers import FusedLinear, RMSNorm, RotaryEmbedding  # noqa: E402
from mlaserve.model.loader import build_model  # noqa: E402

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or TRITON_INTERPRET=1")

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# dtype -> (atol, rtol) against the float32 references
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3),
              torch.bfloat16: (3e-2, 3e-2)}
EPS = 1e-6
ROPE_DIM = 16


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _angles(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, ROPE_DIM / 2] float32 at scattered positions, from YaRN tables whose
    cos/sin scale is not 1."""
    rotary = RotaryEmbedding(ROPE_DIM, 512, 10000.0, YarnScaling(4.0, 128), interleaved=True)
    positions = torch.randperm(512, generator=torch.Generator().manual_seed(num_tokens))
    cos, sin = rotary.angles(positions[:num_tokens])
    return cos.to(DEVICE), sin.to(DEVICE)


def _check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,inter", [(1, 64), (3, 1100)])
def test_silu_and_mul(dtype: torch.dtype, num_tokens: int, inter: int) -> None:
    wide = _randn(num_tokens, 2 * inter + 8, dtype=dtype, seed=0)
    gate_up = wide[:, : 2 * inter]  # [T, 2I] with a row stride of 2I + 8; 1100 spans 2 blocks
    out = silu_and_mul(gate_up)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    gate, up = gate_up.float().chunk(2, dim=-1)
    _check(out, torch.nn.functional.silu(gate) * up, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _check(out, (torch.nn.functional.silu(gate) * up).float(), dtype)  # torch's rounding


def _assert_quantizes(quantized: QuantizedActivations, dense: torch.Tensor) -> None:
    """quantized holds dense [T, N] (the kernel's own unquantized output) quantized per token
    and 128 columns: scales amax / 448 (1 for a zero group), M-major; values dense / scale,
    saturated, in the values' dtype (FP8 on CUDA: torch's rounding), bit for bit."""
    rows, cols = dense.shape
    groups = -(-cols // 128)
    padded = F.pad(dense.float(), (0, groups * 128 - cols)).view(rows, groups, 128)
    amax = padded.abs().amax(dim=-1)  # [T, G]
    # a tensor divisor: CUDA torch multiplies by a Python scalar's reciprocal instead
    scales = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    values = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).view(rows, -1)[:, :cols]
    assert quantized.dtype == dense.dtype and quantized.shape == (rows, cols)
    assert quantized.values.dtype == (FP8_DTYPE if ON_GPU else torch.float32)
    assert quantized.scales.stride() == (1, scales_column_stride(rows))  # M-major
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
def test_add_and_norm_keeping_the_rows_stores_both_in_one_launch(dtype: torch.dtype) -> None:
    """keep_rows (the MoE's input: rows for its router, quantized rows for its experts): x
    holds the normed rows as without quantize, and the quantized rows are those of quantize
    alone, bit for bit."""
    x = _randn(5, 320, dtype=dtype, seed=5)
    residual = _randn(5, 320, dtype=dtype, seed=6)
    weight = _randn(320, dtype=dtype, seed=7)
    dense, dense_residual = fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS)
    alone, _ = fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS, quantize=True)
    x_in = x.clone()
    both, new_residual = fused_add_rms_norm(x_in, residual.clone(), weight, EPS, quantize=True,
                                            keep_rows=True)
    assert isinstance(both, QuantizedWithRows) and both.rows is x_in
    assert torch.equal(both.rows, dense) and torch.equal(new_residual, dense_residual)
    assert torch.equal(both.quantized.values.float(), alone.values.float())
    assert torch.equal(both.quantized.scales, alone.scales)
    _assert_quantizes(both.quantized, dense)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,inter", [(1, 64), (3, 200), (2, 1100)])
def test_silu_and_mul_quantized_is_the_activation_then_quantized(
        dtype: torch.dtype, num_tokens: int, inter: int) -> None:
    gate_up = _randn(num_tokens, 2 * inter + 8, dtype=dtype, seed=inter)[:, : 2 * inter]
    quantized = silu_and_mul(gate_up, quantize=True)  # 1100: two column blocks of 8 groups
    _assert_quantizes(quantized, silu_and_mul(gate_up))


def test_fused_linear_stacks_weights_into_shared_storage() -> None:
    gen = torch.Generator().manual_seed(0)
    first, second = torch.nn.Linear(6, 4, bias=False), torch.nn.Linear(6, 3, bias=True)
    x = torch.randn(5, 6, generator=gen)
    expected = torch.cat((first(x), second(x)), dim=-1)
    fused = FusedLinear(first, second)
    assert fused.weight.shape == (7, 6) and fused.bias.shape == (7,)
    torch.testing.assert_close(fused(x), expected)
    assert first.weight.data_ptr() == fused.weight.data_ptr()  # views: one copy of the weights
    assert second.bias.data_ptr() == fused.bias[4:].data_ptr()
    assert FusedLinear(first).bias is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden_size", [(1, 64), (5, 48)])
def test_rms_norm(dtype: torch.dtype, num_tokens: int, hidden_size: int) -> None:
    wide = _randn(num_tokens, hidden_size + 8, dtype=dtype, seed=0)
    x = wide[:, :hidden_size]  # [T, N] with a row stride of N + 8
    weight = _randn(hidden_size, dtype=dtype, seed=1)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == dtype
    _check(out, rms_norm_reference(x, weight, EPS), dtype)
    norm = RMSNorm(hidden_size, EPS).to(DEVICE, dtype)
    norm.weight.data.copy_(weight)
    _check(out, norm._normalize(x).float(), dtype)  # the torch path's rounding


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_fused_add_rms_norm_updates_both_in_place(dtype: torch.dtype, num_tokens: int) -> None:
    x = _randn(num_tokens, 48, dtype=dtype, seed=2)
    residual = _randn(num_tokens, 48, dtype=dtype, seed=3)
    weight = _randn(48, dtype=dtype, seed=4)
    expected_sum = x.float() + residual.float()
    x_in, residual_in = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x_in, residual_in, weight, EPS)
    assert normed is x_in and new_residual is residual_in
    _check(new_residual, expected_sum, dtype)
    # normalised as stored: the sum rounded to the dtype once
    _check(normed, rms_norm_reference(new_residual, weight, EPS), dtype)
    torch.testing.assert_close(new_residual, x + residual, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_rope_into_the_absorbed_query(dtype: torch.dtype, interleaved: bool,
                                      num_tokens: int) -> None:
    num_heads, nope, rank = 3, 8, 32
    q = _randn(num_tokens, num_heads, nope + ROPE_DIM, dtype=dtype, seed=5)
    q_pe = q[..., nope:]  # [T, H, R] view
    cos, sin = _angles(num_tokens)
    expected = rope_reference(q_pe, cos, sin, interleaved)
    q_abs = torch.full((num_tokens, num_heads, rank + ROPE_DIM), float("nan"), dtype=dtype,
                       device=DEVICE)
    out = rotary_embedding(q_pe, cos, sin, interleaved, out=q_abs[..., rank:])
    _check(out, expected, dtype)
    assert torch.isnan(q_abs[..., :rank]).all()  # the q_latent columns are untouched
    rotary = RotaryEmbedding(ROPE_DIM, 8, 10000.0, None, interleaved)
    _check(out, rotary._rotate(q_pe, (cos, sin)).float(), dtype)  # the torch path

    before = q.clone()
    rotary_embedding(q_pe, cos, sin, interleaved, out=q_pe)  # in place, as prefill rows do
    _check(q[..., nope:], expected, dtype)
    assert torch.equal(q[..., :nope], before[..., :nope])
    flat = rotary_embedding(before[:, 0, nope:], cos, sin, interleaved)  # [T, R]
    _check(flat, expected[:, 0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("num_tokens,kv_lora_rank", [(1, 32), (5, 24)])
@pytest.mark.parametrize("keep_rows", [False, True], ids=["decode", "prefill"])
def test_latent_write_touches_only_its_slots(dtype: torch.dtype, interleaved: bool,
                                             num_tokens: int, kv_lora_rank: int,
                                             keep_rows: bool) -> None:
    width = kv_lora_rank + ROPE_DIM
    num_blocks, block_size = 6, 4
    kv = _randn(num_tokens, width, dtype=dtype, seed=6)
    weight = _randn(kv_lora_rank, dtype=dtype, seed=7)
    cos, sin = _angles(num_tokens)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(8))
    slots = slots[:num_tokens].to(DEVICE)
    cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=dtype, device=DEVICE)
    expected = latent_rows_reference(kv, weight, EPS, cos, sin, interleaved)
    kv_in = kv.clone()
    write_latent(kv_in, weight, EPS, cos, sin, interleaved, cache.view(-1, width), slots,
                 latent_out=kv_in if keep_rows else None)
    rows = cache.view(-1, width)  # [num_slots, L + R]
    _check(rows[slots], expected, dtype)
    untouched = torch.ones(len(rows), dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(rows[untouched]).all()
    if keep_rows:
        torch.testing.assert_close(kv_in, rows[slots], atol=0, rtol=0)
    else:
        assert torch.equal(kv_in, kv)


TINY = dict(model_type="deepseek_v2", vocab_size=64, hidden_size=48, intermediate_size=64,
            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=3,
            n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=32,
            qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=16, v_head_dim=16,
            first_k_dense_replace=1, max_position_embeddings=64, torch_dtype="float32")


def _step_metadata(backend: MLABackend, block_size: int
                   ) -> tuple[torch.Tensor, AttentionMetadata]:
    """A mixed step of 7 tokens on shuffled pages: two decodes (5 and 0 tokens already
    cached), then prefills of 3 and 2 tokens. Returns positions [7] and the metadata (the
    backend planned for the decodes)."""
    positions = torch.tensor([5, 0, 0, 1, 2, 0, 1])
    pages = {"a": [3, 7], "b": [2], "c": [9], "d": [5]}
    slot = {name: [p * block_size + i for p in ids for i in range(block_size)]
            for name, ids in pages.items()}  # request -> its cache slots in token order
    slots = torch.tensor([slot["a"][5], slot["b"][0], *slot["c"][:3], *slot["d"][:2]])
    table = torch.tensor([pages["a"], pages["b"] + [0]], dtype=torch.int32)  # [2, 2]
    backend.plan(table, torch.tensor([6, 1], dtype=torch.int32))
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=2, decode_backend=backend,
        prefills=[PrefillChunk(token_start=2, num_tokens=3, context_slots=None),
                  PrefillChunk(token_start=5, num_tokens=2, context_slots=None)])
    return positions, meta


QLORA_YARN = dict(q_lora_rank=24, rope_interleave=False,
                  rope_scaling={"type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 16, "mscale": 0.707,
                                "mscale_all_dim": 0.707})


@pytest.mark.skipif(ON_GPU, reason="compares the interpreted kernels with the CPU torch path")
@pytest.mark.parametrize("overrides,quantized_inputs", [
    (dict(q_lora_rank=None, rope_interleave=True), 0),
    (QLORA_YARN, 0),
    # FP8 Linears: per layer, the input norm's output (for q_a + kv_a) and q_a_layernorm's (for
    # q_b); in the dense layer also the post-attention norm's (gate_up) and SiLU-and-mul's
    # (down). The MoE layer's input is not quantized (its router reads it).
    (dict(QLORA_YARN, quantization_config=FP8_QUANTIZATION_CONFIG), 6),
], ids=["v2-interleaved", "qlora-neox-yarn", "qlora-fp8"])
def test_model_with_fused_kernels_equals_the_torch_path(overrides: dict, quantized_inputs: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same step, hidden states and cache rows with the kernels forced on as on the torch
    path. With FP8 Linears, the forced kernels hand them quantized inputs, the torch path its
    inputs as they are: equal here, where the interpreter keeps the quantized values in
    float32 (see `fp8_activations`)."""
    config = ModelConfig.from_dict({**TINY, **overrides})
    model = build_model(config, None, device=DEVICE, dtype=torch.float32, load_format="dummy",
                        max_positions=64, quantization="fp8" if config.quant_method else "auto")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            elif "scale_inv" in name:  # FP8 weights' block scales
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    model.process_weights_after_loading()
    allocated = []
    empty_quantized = fused_norm_rope.empty_quantized
    monkeypatch.setattr(fused_norm_rope, "empty_quantized",
                        lambda *args: allocated.append(args) or empty_quantized(*args))
    block_size = 4
    shape = MLAShape(num_heads=config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
                     qk_rope_head_dim=config.qk_rope_head_dim, block_size=block_size,
                     dtype=torch.float32, device=DEVICE)
    backend = create_backend("torch", shape, config.softmax_scale)
    positions, meta = _step_metadata(backend, block_size)
    input_ids = torch.randint(0, config.vocab_size, (7,), generator=gen)
    caches = [torch.randn(12, block_size, config.kv_cache_dim, generator=gen)
              for _ in range(config.num_hidden_layers)]
    fused_caches = [c.clone() for c in caches]
    with torch.inference_mode():
        expected = model(input_ids, positions, caches, meta)
        with force_fused_kernels():
            actual = model(input_ids, positions, fused_caches, meta)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert len(allocated) == quantized_inputs
    for fused, ref in zip(fused_caches, caches, strict=True):
        torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
