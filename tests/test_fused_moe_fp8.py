"""Block-FP8 (w8a8) experts through `fused_experts`.

The Triton kernels (Triton's interpreter on CPU) against a float64 reference built from the same
operands: the same dequantized weights and the same per-token-group quantized x and activation,
so only the accumulation differs. The other implementations dequantize the weights (weight-only)
and must equal the 16-bit path run on the dequantized weights in float32.
"""

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels import fused_moe  # noqa: E402
from mlaserve.kernels.fp8_activations import quantize_activations  # noqa: E402
from mlaserve.kernels.fp8_blocks import (  # noqa: E402
    dequantize_block_fp8,
    quantize_block_fp8,
)
from mlaserve.kernels.fused_moe import fused_experts_triton, gate_up_silu  # noqa: E402
from mlaserve.kernels.fused_moe_config import FusedMoEConfig, GemmTiles  # noqa: E402
from mlaserve.kernels.moe import (  # noqa: E402
    W8A8_REFERENCE_TOLERANCES,
    fused_experts,
    fused_experts_loop,
    fused_experts_w8a8_reference,
    reference_errors,
)
from mlaserve.kernels.moe_align import align_by_expert  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def dequantize_experts(proj: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The reference dequantization of a stack [E, N, K]: each expert's 2-D weight on its own."""
    return torch.stack([dequantize_block_fp8(weight, scale)
                        for weight, scale in zip(proj, scale_inv, strict=True)])


needs_triton = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or TRITON_INTERPRET=1")
# The interpreter's bfloat16 casts truncate, so bfloat16 x is checked on the GPU only.
DTYPES = [torch.float32] + ([torch.bfloat16] if ON_GPU else [])
# (relative error, 1 - least per-row cosine) against the w8a8 reference: on a GPU
# `W8A8_REFERENCE_TOLERANCES` (Hopper's FP8 sums); the interpreter multiplies FP8 values exactly
# and sums in float32: float32 rounding only (~1e-7 seen).
BOUNDS = W8A8_REFERENCE_TOLERANCES if ON_GPU else (1e-5, 1e-9)
# several M-, N- and K-blocks, two K steps per scale block (gate) and 32-column tiles
SMALL_TILES = FusedMoEConfig(
    block_m=16,
    gate_up=GemmTiles(block_n=32, block_k=64, group_size_m=2, num_warps=4, num_stages=2),
    down=GemmTiles(block_n=64, block_k=32, group_size_m=1, num_warps=4, num_stages=2),
)
# the same tiles computed transposed (W x^T: FP8 wgmma on sm_90) in both kernels
SWAPPED_TILES = FusedMoEConfig(
    block_m=16, gate_up=dataclasses.replace(SMALL_TILES.gate_up, swap_ab=True),
    down=dataclasses.replace(SMALL_TILES.down, swap_ab=True))

# gate tiles one scale group wide: the gate kernel quantizes its activation in its epilogue
EPILOGUE_TILES = FusedMoEConfig(
    block_m=16, gate_up=dataclasses.replace(SMALL_TILES.gate_up, block_n=128),
    down=SMALL_TILES.down)
EPILOGUE_SWAPPED_TILES = FusedMoEConfig(
    block_m=16, gate_up=dataclasses.replace(SWAPPED_TILES.gate_up, block_n=128),
    down=SWAPPED_TILES.down)


def make_fp8_inputs(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """`fused_experts` keyword inputs on DEVICE: x [T, D] float32, FP8 stacks of E routed
    experts plus one shared expert (id E, the last column of topk_ids, weight 1), each token's
    routed experts distinct."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts + 1, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(num_experts + 1, hidden, inter, generator=gen) / inter ** 0.5
    gate_up_proj, gate_up_scale_inv = quantize_block_fp8(gate_up)  # each expert on its own
    down_proj, down_scale_inv = quantize_block_fp8(down)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(num_tokens)])
    ids = torch.cat((ids, torch.full((num_tokens, 1), num_experts)), dim=1)  # [T, K + 1]
    weights = torch.cat((torch.rand(num_tokens, top_k, generator=gen) + 0.1,
                         torch.ones(num_tokens, 1)), dim=1)
    inputs = dict(x=torch.randn(num_tokens, hidden, generator=gen), gate_up_proj=gate_up_proj,
                  down_proj=down_proj, topk_weights=weights, topk_ids=ids,
                  gate_up_scale_inv=gate_up_scale_inv, down_scale_inv=down_scale_inv)
    return {name: tensor.to(DEVICE) for name, tensor in inputs.items()}


def w8a8_reference(**inputs: torch.Tensor) -> torch.Tensor:
    """`fused_experts_w8a8_reference` in float64, [T, D]."""
    return fused_experts_w8a8_reference(**inputs, compute_dtype=torch.float64)


def assert_within(out: torch.Tensor, ref: torch.Tensor, bounds: tuple[float, float]) -> None:
    rel_err, cos_gap = reference_errors(out, ref)
    assert rel_err < bounds[0] and cos_gap < bounds[1], (rel_err, cos_gap)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    "config", [None, SMALL_TILES, SWAPPED_TILES, EPILOGUE_TILES, EPILOGUE_SWAPPED_TILES],
    ids=["default", "small", "small-swapped", "epilogue-quantized", "epilogue-swapped"])
@pytest.mark.parametrize("shape", [(5, 256, 128, 4, 2), (3, 320, 256, 4, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_triton_w8a8_matches_the_reference(shape, config, dtype) -> None:
    """T, D, I, E, K: D = 320 ends in a partial scale block (and a ragged K edge), I = 256 gives
    gate and up two scale rows each."""
    inputs = make_fp8_inputs(*shape)
    inputs["x"] = inputs["x"].to(dtype)
    out = fused_experts_triton(**inputs, config=config, shared_experts=1)
    assert out.shape == inputs["x"].shape and out.dtype == dtype
    bounds = BOUNDS if dtype == torch.float32 else W8A8_REFERENCE_TOLERANCES
    assert_within(out, w8a8_reference(**inputs), bounds)


@needs_triton
def test_dispatch_runs_triton_and_the_bound_catches_a_dropped_block_or_pair() -> None:
    """impl="triton" through `fused_experts`; then the same kernels fed one zeroed weight-scale
    block (one K block of one expert's gate rows) or one zeroed routing weight fail the bound
    clearly: by 3x in relative error and 10x in cosine (on an H100 the zeroed block gave
    3.4e-2 and 2.6e-3 against the bounds' 1e-2 and 1e-4; in the interpreter the margins are
    orders of magnitude wider)."""
    inputs = make_fp8_inputs(5, 256, 128, 4, 2)
    ref = w8a8_reference(**inputs)
    assert_within(fused_experts(**inputs, impl="triton", shared_experts=1), ref, BOUNDS)
    expert = int(inputs["topk_ids"][0, 0])
    no_block = inputs["gate_up_scale_inv"].clone()
    no_block[expert, 0, 1] = 0  # gate rows 0-127, columns 128-255
    no_pair = inputs["topk_weights"].clone()
    no_pair[2, 1] = 0  # token 2 loses its second routed expert
    for wrong in (dict(gate_up_scale_inv=no_block), dict(topk_weights=no_pair)):
        out = fused_experts_triton(**{**inputs, **wrong}, config=SMALL_TILES, shared_experts=1)
        rel_err, cos_gap = reference_errors(out, ref)
        assert rel_err > 3 * BOUNDS[0] and cos_gap > 10 * BOUNDS[1], (rel_err, cos_gap)


@needs_triton
@pytest.mark.parametrize("tiles", [EPILOGUE_TILES.gate_up, EPILOGUE_SWAPPED_TILES.gate_up],
                         ids=["tiles", "swapped"])
def test_gate_kernel_quantizes_its_activation_as_a_separate_launch_would(tiles) -> None:
    """The epilogue's quantization (block_n = 128) against `quantize_activations` of the same
    kernel's unquantized activation: the same FP8 bits and scales on every routed row (rows of
    padding are not written). Zeroed rows (token 1's x) get scale 1, as the launch gives them."""
    inputs = make_fp8_inputs(6, 320, 256, 4, 2)
    inputs["x"][1] = 0
    x_q, x_scales = quantize_activations(inputs["x"])
    top_k = inputs["topk_ids"].shape[1]
    alignment = align_by_expert(inputs["topk_ids"], inputs["gate_up_proj"].shape[0], 16)
    scales = (x_scales, inputs["gate_up_scale_inv"])
    fused = gate_up_silu(x_q, inputs["gate_up_proj"], alignment, top_k, tiles, scales,
                         act_dtype=torch.float32, quantize_act=True)
    plain = gate_up_silu(x_q, inputs["gate_up_proj"], alignment, top_k, tiles, scales,
                         act_dtype=torch.float32)
    want_values, want_scales = quantize_activations(plain)
    routed = alignment.sorted_ids < inputs["topk_ids"].numel()
    assert int(routed.sum()) == inputs["topk_ids"].numel()
    assert fused.values.dtype == want_values.dtype == torch.float8_e4m3fn
    assert torch.equal(fused.values[routed].view(torch.uint8),
                       want_values[routed].view(torch.uint8))
    assert torch.equal(fused.scales[routed], want_scales[routed])
    token_one = (alignment.sorted_ids // top_k == 1) & routed
    assert torch.all(fused.scales[token_one] == 1)
    with pytest.raises(ValueError, match="block_n 128 only, not block_n 32"):
        gate_up_silu(x_q, inputs["gate_up_proj"], alignment, top_k, SMALL_TILES.gate_up, scales,
                     quantize_act=True)


@needs_triton
def test_x_quantized_by_its_producer_gives_the_same_output() -> None:
    """x quantized by the norm before the MoE (`x_quantized`, as `fused_add_rms_norm(...,
    keep_rows=True)` gives it) is read instead of quantizing x again: the same output, bit for
    bit; the weight-only paths read x and ignore it."""
    from mlaserve.kernels.fused_norm_rope import fused_add_rms_norm

    inputs = make_fp8_inputs(5, 320, 256, 4, 2)
    residual = torch.randn(5, 320, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    weight = torch.ones(320, device=DEVICE)
    both, _ = fused_add_rms_norm(inputs["x"].clone(), residual, weight, 1e-6, quantize=True,
                                 keep_rows=True)
    inputs["x"] = both.rows
    want = fused_experts_triton(**inputs, config=SMALL_TILES, shared_experts=1)
    got = fused_experts_triton(**inputs, config=SMALL_TILES, shared_experts=1,
                               x_quantized=both.quantized)
    assert torch.equal(got, want)
    loop = fused_experts(**inputs, impl="loop", shared_experts=1)
    assert torch.equal(fused_experts(**inputs, impl="loop", shared_experts=1,
                                     x_quantized=both.quantized), loop)


@needs_triton
def test_activation_scales_are_read_in_either_layout(monkeypatch) -> None:
    """CUDA's `quantize_activations` writes M-major scales [T, G] (strides (1, T) for T a
    multiple of 4), the CPU's row-major ones: the kernels read both by their strides, to the
    same output."""
    inputs = make_fp8_inputs(5, 320, 256, 4, 2)
    want = fused_experts_triton(**inputs, config=SMALL_TILES, shared_experts=1)

    def m_major(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, scales = quantize_activations(x)
        rows, groups = scales.shape
        return values, torch.empty_strided((rows, groups), (1, rows),
                                           device=scales.device).copy_(scales)

    monkeypatch.setattr(fused_moe, "quantize_activations", m_major)
    assert torch.equal(fused_experts_triton(**inputs, config=SMALL_TILES, shared_experts=1), want)


@pytest.mark.parametrize("impl", ["auto", "grouped", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_weight_only_paths_equal_the_dequantized_weights(impl, dtype) -> None:
    """Without Triton the FP8 stacks are dequantized and run in float32: the float32 loop over
    the dequantized stacks, rounded once to x's dtype."""
    inputs = make_fp8_inputs(5, 256, 128, 4, 2)
    x = inputs["x"].to(dtype)
    if impl == "auto" and DEVICE.type == "cuda":
        pytest.skip("auto runs Triton on CUDA")
    gate_up = dequantize_experts(inputs["gate_up_proj"], inputs["gate_up_scale_inv"])
    down = dequantize_experts(inputs["down_proj"], inputs["down_scale_inv"])
    ref = fused_experts_loop(x.float(), gate_up, down, inputs["topk_weights"],
                             inputs["topk_ids"], compute_dtype=torch.float32)
    out = fused_experts(**{**inputs, "x": x}, impl=impl, shared_experts=1)
    assert out.dtype == dtype
    bounds = (1e-5, 1e-9) if dtype == torch.float32 else (4e-3, 2e-5)  # one bf16 rounding
    assert_within(out, ref, bounds)


def test_bad_fp8_inputs_raise() -> None:
    inputs = make_fp8_inputs(2, 256, 128, 4, 2)
    scales = inputs["gate_up_scale_inv"]
    bad_inputs = [  # (wrong inputs, the error's words)
        (dict(down_scale_inv=None), "need both"),
        (dict(gate_up_scale_inv=None, down_scale_inv=None), "need both"),  # FP8 weights only
        (dict(down_proj=inputs["down_proj"].float()), "float8_e4m3fn"),
        (dict(gate_up_scale_inv=scales.double()), "not float32"),
        (dict(gate_up_scale_inv=scales[:, :, :1]), r"is torch.float32 \(5, 2, 1\), not"),
        (dict(x=inputs["x"][:, :128]), r"are not \[T, D\]"),
    ]
    for wrong, message in bad_inputs:
        for impl in ("triton", "loop"):
            with pytest.raises(ValueError, match=message):
                fused_experts(**{**inputs, **wrong}, impl=impl)
    narrow = make_fp8_inputs(2, 256, 64, 4, 2)  # I = 64: the up rows start inside a block
    with pytest.raises(ValueError, match="multiple of 128"):
        fused_experts(**narrow)
    deep_k = FusedMoEConfig(block_m=16, gate_up=SMALL_TILES.gate_up,
                            down=GemmTiles(block_n=64, block_k=256, group_size_m=1, num_warps=4,
                                           num_stages=2))
    with pytest.raises(ValueError, match="block_k dividing 128"):
        fused_experts_triton(**inputs, config=deep_k)


@pytest.mark.gpu
def test_v2_lite_shape_bf16_w8a8_and_cuda_graph_replay() -> None:
    """DeepSeek-V2-Lite's expert shape (D = 2048, I = 1408 = 11 blocks) in bf16 against the
    reference, and a CUDA-graph replay of the FP8 path (quantizations included)."""
    inputs = make_fp8_inputs(16, 2048, 1408, 8, 6)
    inputs["x"] = inputs["x"].to(torch.bfloat16)
    eager = fused_experts(**inputs, impl="triton", shared_experts=1)
    assert_within(eager, w8a8_reference(**inputs), W8A8_REFERENCE_TOLERANCES)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_experts(**inputs, impl="triton", shared_experts=1)
    inputs["x"].copy_(torch.flip(inputs["x"], dims=[0]))
    inputs["topk_ids"].copy_(torch.flip(inputs["topk_ids"], dims=[0]))
    inputs["topk_weights"].copy_(torch.flip(inputs["topk_weights"], dims=[0]))
    graph.replay()
    torch.testing.assert_close(captured, torch.flip(eager, dims=[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [EPILOGUE_TILES, EPILOGUE_SWAPPED_TILES],
                         ids=["tiles", "swapped"])
def test_v2_lite_shape_epilogue_quantized_activation(config) -> None:
    """V2-Lite's expert shape in bf16 with the activation quantized by the gate kernel (FP8
    rounding on the GPU): within the w8a8 reference's bound."""
    inputs = make_fp8_inputs(64, 2048, 1408, 8, 6)
    inputs["x"] = inputs["x"].to(torch.bfloat16)
    out = fused_experts_triton(**inputs, config=config, shared_experts=1)
    assert_within(out, w8a8_reference(**inputs), W8A8_REFERENCE_TOLERANCES)


@pytest.mark.gpu
def test_moe_input_quantized_by_the_norm_changes_no_output(monkeypatch) -> None:
    """The demo model quantized online (FP8 experts, w8a8 through Triton): its MoE input
    quantized by the norm before it (one launch for the router's rows and the experts' FP8
    rows) gives the same greedy tokens and prompt logprobs as the MoE quantizing it itself."""
    from mlaserve import LLM, SamplingParams
    from mlaserve.model import moe_layer

    params = SamplingParams(max_tokens=16, temperature=0, prompt_logprobs=1)
    prompts = ["What is 12 + 30?", "Tell me a story about a cat."]
    outputs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(moe_layer, "runs_w8a8", lambda x, gate_up: False)
        llm = LLM(device="cuda", dtype="bfloat16", quantization="fp8")
        try:
            moe = next(m for m in llm.engine.runner.model.modules()
                       if isinstance(m, moe_layer.MoE))
            probe = torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16)
            assert moe.quantizes_input(probe) == fused
            outputs.append([(o.outputs[0].token_ids, o.prompt_logprobs)
                            for o in llm.generate(prompts, params)])
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]
