"""Block-FP8 weights kept FP8 in the model (`mlaserve.model.fp8_linear`): FP8 experts with the
shared experts folded in, tensor- and expert-parallel reads of FP8 weights and their scale
blocks, the shard rule's error, FP8 dummy weights, the CUDA GEMM, and Linears reading input
that its producer quantized. On a checkpoint whose expert I and tensor-parallel shards are
whole 128-blocks."""

import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.config import ModelConfig
from mlaserve.distributed import TensorParallelGroup, expert_parallel, parallel_state
from mlaserve.kernels.fp8_blocks import (
    FP8_DTYPE,
    FP8_MAX,
    QuantizedActivations,
    dequantize_block_fp8,
    quantize_block_fp8,
)
from mlaserve.model import loader
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.fp8_checkpoint import dequantize_checkpoint, quantize_checkpoint
from mlaserve.model.fp8_linear import linear
from mlaserve.model.loader import _cut, _cuts, build_model
from mlaserve.model.moe_layer import MoE
from mlaserve.model.parallel_linear import ShardSpec
from tests.conftest import CHECKPOINTS, write_checkpoint

PROMPTS = [[0, 5, 17, 42, 99, 3, 250, 7], [0, 200, 1, 13]]


@pytest.fixture(scope="module")
def aligned_pair(tmp_path_factory):
    """A two-layer V3 checkpoint (dense layer, then MoE with a shared expert) whose shards under
    tensor parallelism 2 are whole 128-blocks (q_b 256 rows, o_proj 256 columns, dense MLP 256,
    expert I 256), with partial blocks along the hidden size (200): (its FP8 copy in the
    published layout, that copy dequantized, the checkpoint itself in float32)."""
    arch, overrides, _ = CHECKPOINTS["v3-noaux-lora-yarn-sharded"]
    root = tmp_path_factory.mktemp("fp8-aligned")
    write_checkpoint(root / "bf16", arch, {
        **overrides, "num_hidden_layers": 2, "hidden_size": 200, "num_attention_heads": 8,
        "num_key_value_heads": 8, "v_head_dim": 32, "intermediate_size": 256,
        "moe_intermediate_size": 256}, sharded=True)
    quantize_checkpoint(root / "bf16", root / "fp8")
    dequantize_checkpoint(root / "fp8", root / "dequantized", torch.float32)
    return root / "fp8", root / "dequantized", root / "bf16"


def _build(path, quantization: str, load_format: str = "safetensors") -> DeepseekForCausalLM:
    return build_model(ModelConfig.from_pretrained(path), path, device=torch.device("cpu"),
                       dtype=torch.float32, load_format=load_format, max_positions=64,
                       quantization=quantization)


def test_fp8_experts_give_the_dequantized_models_logprobs(aligned_pair):
    """Routed and shared experts stay FP8 (one stack of E + S experts with per-expert scale
    stacks), and the model scores prompts as the dequantized checkpoint does."""
    fp8_dir, dequantized_dir, _ = aligned_pair
    moe = _build(fp8_dir, "fp8").model.layers[1].mlp
    assert isinstance(moe, MoE) and moe.num_shared_experts == 1
    assert moe.gate_up_stack.dtype == moe.down_stack.dtype == FP8_DTYPE
    assert moe.gate_up_stack.shape == (9, 512, 200) and moe.down_stack.shape == (9, 200, 256)
    assert moe.gate_up_scale_stack.shape == (9, 4, 2)  # [E + S, 2I / 128, ceil(D / 128)]
    assert moe.down_scale_stack.shape == (9, 2, 2)  # [E + S, ceil(D / 128), I / 128]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    outs = [LLM(str(path), device="cpu", num_kv_blocks=16, block_size=16,
                quantization=quantization).generate(PROMPTS, params)
            for path, quantization in [(fp8_dir, "fp8"), (dequantized_dir, "auto")]]
    for got, want in zip(*outs, strict=True):
        assert got.token_ids == want.token_ids
        for got_pos, want_pos in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:],
                                     strict=True):
            assert got_pos.keys() == want_pos.keys()
            assert all(abs(got_pos[t] - lp) <= 1e-4 for t, lp in want_pos.items())


@pytest.mark.parametrize("tp_rank,ep_rank", [(1, None), (0, 1), (1, 1)],
                         ids=["tp2-rank1", "ep2-rank1-tp2-rank0", "ep2-rank1-tp2-rank1"])
def test_parallel_ranks_read_their_fp8_blocks(tp_rank, ep_rank, aligned_pair, monkeypatch):
    """A tensor- / expert-parallel rank's FP8 weights and scales, read from the checkpoint a
    shard at a time, are its cut of the one-process model's (bytes equal)."""
    fp8_dir = aligned_pair[0]
    full = dict(_build(fp8_dir, "fp8").named_parameters())
    monkeypatch.setattr(parallel_state, "_tp_group", TensorParallelGroup(rank=tp_rank, size=2))
    if ep_rank is not None:
        monkeypatch.setattr(expert_parallel, "_ep_group",
                            expert_parallel.ExpertParallelGroup(rank=ep_rank, size=2))
    model = _build(fp8_dir, "fp8")
    cuts = _cuts(model)
    assert "model.layers.1.mlp.experts.gate_up_scale_inv" in cuts
    num_fp8 = 0
    for name, param in model.named_parameters():
        want = full[name] if name not in cuts else _cut(full[name], full[name].shape, cuts[name])
        num_fp8 += param.dtype == FP8_DTYPE
        assert param.dtype == want.dtype and torch.equal(
            param.view(torch.uint8), want.view(torch.uint8)), name
    assert num_fp8 == 13  # q_a, q_b, kv_a, o_proj per layer; the dense MLP's 3; 2 stacks


@pytest.mark.parametrize("tp_rank", [None, 1], ids=["one-process", "tp2-rank1"])
def test_quantization_fp8_quantizes_a_high_precision_checkpoint_as_it_loads(
        tp_rank, aligned_pair, monkeypatch):
    """--quantization fp8 on a float32 checkpoint: its FP8 weights and scales are those of its
    published-format FP8 copy (bytes equal: the same 128x128 blocks), for a tensor-parallel
    rank too (its shard quantized); every other parameter, kv_b_proj included, is the
    checkpoint's own, as without quantization."""
    fp8_dir, _, original_dir = aligned_pair
    if tp_rank is not None:
        monkeypatch.setattr(parallel_state, "_tp_group", TensorParallelGroup(rank=tp_rank, size=2))
    published = dict(_build(fp8_dir, "fp8").named_parameters())
    plain = dict(_build(original_dir, "auto").named_parameters())
    quantized = dict(_build(original_dir, "fp8").named_parameters())
    assert quantized.keys() == published.keys()
    num_fp8 = 0
    for name, param in quantized.items():
        fp8 = param.dtype == FP8_DTYPE or name.endswith("_scale_inv")
        num_fp8 += param.dtype == FP8_DTYPE
        want = published[name] if fp8 else plain[name]
        assert param.dtype == want.dtype and torch.equal(
            param.view(torch.uint8), want.view(torch.uint8)), name
    assert num_fp8 == 13  # q_a, q_b, kv_a, o_proj per layer; the dense MLP's 3; 2 stacks


def test_fused_experts_are_not_quantized_as_they_load(tmp_path):
    """Experts stored fused (3-D) in high precision, which --quantization fp8 would keep FP8:
    a clear error that says how to get a checkpoint it loads."""
    arch, overrides, _ = CHECKPOINTS["v3-noaux-lora-yarn-sharded"]
    write_checkpoint(tmp_path, arch, {**overrides, "num_hidden_layers": 2,
                                      "moe_intermediate_size": 128}, sharded=False)
    tensors = load_file(tmp_path / "model.safetensors")
    prefix = "model.layers.1.mlp.experts"
    num_experts = ModelConfig.from_pretrained(tmp_path).n_routed_experts
    tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([
        tensors.pop(f"{prefix}.{e}.{part}.weight") for part in ("gate_proj", "up_proj")])
        for e in range(num_experts)])  # [E, 2I, D]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"gate_up_proj stores the experts fused .* quantize "
                                         r"SRC DST\), or load with --quantization auto"):
        _build(tmp_path, "fp8")
    _build(tmp_path, "auto")  # the fused layout in high precision loads as it is


def test_fp8_shards_must_cover_whole_scale_blocks(aligned_pair, monkeypatch):
    monkeypatch.setattr(parallel_state, "_tp_group", TensorParallelGroup(rank=0, size=4))
    with pytest.raises(ValueError) as info:
        _build(aligned_pair[0], "fp8")
    assert str(info.value) == (
        "model.layers.0.self_attn.q_b_proj: under tensor_parallel_size 4 each rank holds 256 / "
        "4 = 64 rows (output features) of the FP8 weight, which does not cover whole 128x128 "
        "scale blocks (it must be a multiple of 128): use --quantization none to dequantize "
        "the weights at load, or a tensor-parallel size that keeps the shards block-aligned")
    _build(aligned_pair[0], "none")  # dequantized at load, any shard


@pytest.mark.parametrize("quantization", ["auto", "fp8"])
def test_dummy_fp8_weights_are_fp8_and_the_model_runs(aligned_pair, quantization):
    """An FP8 config with dummy weights: FP8 Linear and expert weights (half the bytes of
    bf16) of the other dummy weights' magnitude, and finite outputs, where the FP8 path is on;
    model-dtype weights elsewhere (auto on the CPU)."""
    path = aligned_pair[0]
    model = _build(path, quantization, load_format="dummy")
    fp8 = {n: p for n, p in model.named_parameters() if p.dtype == FP8_DTYPE}
    assert len(fp8) == (13 if quantization == "fp8" else 0)
    for name, weight in fp8.items():
        scale = model.get_parameter(  # X.weight_scale_inv; experts.gate_up_scale_inv
            name + "_scale_inv" if name.endswith(".weight")
            else name.removesuffix("_proj") + "_scale_inv")
        pairs = zip(weight, scale, strict=True) if weight.dim() == 3 else [(weight, scale)]
        for w, s in pairs:
            assert 0.01 < dequantize_block_fp8(w, s).abs().max() <= 0.02, name
    llm = LLM(str(path), device="cpu", num_kv_blocks=16, block_size=16, load_format="dummy",
              quantization=quantization)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1,
                                               ignore_eos=True))
    for request in out:
        assert len(request.token_ids) == 2
        assert all(math.isfinite(v) for pos in request.prompt_logprobs[1:] for v in pos.values())


def test_dummy_tensors_drawn_in_slices_are_one_full_tensor_at_every_parallel_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dummy tensor of many slices: each rank's cut (the stacked [gate | up] halves split in
    two) is the cut of the tensor one process draws, FP8 and float32 alike, and the slices
    are not repeats of one another."""
    monkeypatch.setattr(loader, "DUMMY_DRAW_ELEMENTS", 1000)
    spec = ShardSpec(dim=1, pieces=2)
    for dtype, bound in ((FP8_DTYPE, FP8_MAX), (torch.float32, 0.02)):
        full = torch.empty(4, 256, 48, dtype=dtype)  # 49,152 elements: 50 slices
        loader._draw_uniform(full, [], bound, torch.Generator().manual_seed(3))
        for rank in range(2):
            part = torch.empty(4, 128, 48, dtype=dtype)
            loader._draw_uniform(part, [(spec, rank, 2)], bound,
                                 torch.Generator().manual_seed(3))
            want = spec.take(full, full.shape, rank, 2)
            assert torch.equal(part.view(torch.uint8), want.contiguous().view(torch.uint8))
        values = full.float().view(-1)  # [49152]
        assert values.abs().max() <= bound and values.std() > 0.5 * bound  # uniform: 0.58
        assert not torch.equal(values[:1000], values[1000:2000])


def _moe_input(rank: int, hidden: int) -> torch.Tensor:
    """Rank 0 has 5 tokens, rank 1 three; they exchange 5 rows each (the step's capacity)."""
    return torch.randn(5 if rank == 0 else 3, hidden, generator=torch.Generator().manual_seed(rank))


def _ep_rank_main(rank: int, store: str, fp8_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        expert_parallel.init_expert_parallel()
        moe = _build(Path(fp8_dir), "fp8").model.layers[1].mlp
        assert moe.gate_up_stack.dtype == FP8_DTYPE  # this rank's half of the FP8 experts
        with torch.inference_mode():
            out = moe(_moe_input(rank, moe.gate_up_stack.shape[2]), expert_capacity=5)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        expert_parallel.destroy_expert_parallel()
        dist.destroy_process_group()


def test_expert_parallel_fp8_experts_equal_one_process(aligned_pair, tmp_path):
    """Two gloo ranks, each with half of the FP8 experts and their scales (the shared expert
    on both), compute for their own tokens what one process with all FP8 experts computes."""
    fp8_dir = aligned_pair[0]
    mp.spawn(_ep_rank_main, args=(str(tmp_path / "store"), str(fp8_dir), str(tmp_path)),
             nprocs=2)
    moe = _build(fp8_dir, "fp8").model.layers[1].mlp
    for rank in range(2):
        with torch.inference_mode():
            want = moe(_moe_input(rank, moe.gate_up_stack.shape[2]))
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), want, atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("in_features", [256, 1024])  # w8a8: the Triton product; cuBLASLt's
@pytest.mark.parametrize("weight_only", [True, False])
def test_fp8_linear_on_cuda_runs_the_block_gemm(in_features: int, weight_only: bool,
                                               monkeypatch: pytest.MonkeyPatch):
    """On CUDA `linear` runs the weight-only product up to WEIGHT_ONLY_MAX_ROWS rows (set to 64
    here; off by default until measured): equal, up
    to the bf16 output's rounding, to the float32 product of x and the dequantized weight; past
    that it quantizes x per token and 128 columns and runs the w8a8 product: equal, up to the
    same rounding, to the float32 product of the same quantized operands."""
    from mlaserve.kernels import fp8_gemm
    from mlaserve.kernels.fp8_activations import quantize_activations
    from mlaserve.kernels.fp8_gemm import block_fp8_reference

    monkeypatch.setattr(fp8_gemm, "WEIGHT_ONLY_MAX_ROWS", 64)
    rows = 5 if weight_only else 64 + 3
    gen = torch.Generator().manual_seed(0)
    weight, scale = quantize_block_fp8(torch.randn(304, in_features, generator=gen) * 0.02)
    x = torch.randn(rows, in_features, generator=gen).cuda().bfloat16()
    got = linear(x, weight.cuda(), None, scale.cuda())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 304)
    if weight_only:
        want = x.float().cpu() @ dequantize_block_fp8(weight, scale).T
    else:
        x_q, x_scales = quantize_activations(x)
        want = block_fp8_reference(x_q.cpu(), x_scales.cpu(), weight, scale)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2**-7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("in_features", [256, 1024])  # the Triton product; cuBLASLt's
def test_fp8_linear_reads_its_input_quantized_by_the_producer(in_features: int):
    """A w8a8 product handed its input quantized (as the fused norms and SiLU-and-mul hand it)
    gives the bits it gives when it quantizes that input itself; 67 rows, which cuBLASLt's
    product pads to 68 either way."""
    from mlaserve.kernels.fp8_activations import quantize_activations
    from mlaserve.kernels.fp8_blocks import QuantizedActivations

    gen = torch.Generator().manual_seed(0)
    weight, scale = quantize_block_fp8(torch.randn(304, in_features, generator=gen) * 0.02)
    weight, scale = weight.cuda(), scale.cuda()
    x = torch.randn(67, in_features, generator=gen).cuda().bfloat16()
    quantized = QuantizedActivations(*quantize_activations(x), x.dtype)
    assert torch.equal(linear(quantized, weight, None, scale), linear(x, weight, None, scale))


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


@pytest.mark.gpu
def test_producers_quantizing_the_input_change_no_bit_of_the_model(aligned_pair, monkeypatch):
    """On CUDA the norms and SiLU-and-mul quantize the input of the w8a8 products (prompts of
    40+ tokens: past the weight-only rows); the prompt logprobs and tokens are those of the
    model whose products quantize their own input, bit for bit."""
    from mlaserve.kernels import fused_norm_rope
    from mlaserve.model import fp8_linear

    prompts = [[(11 * i + 5 * j) % 250 + 1 for j in range(40 + 9 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, ignore_eos=True)
    allocated = []  # the producers' quantized outputs
    empty_quantized = fused_norm_rope.empty_quantized
    monkeypatch.setattr(fused_norm_rope, "empty_quantized",
                        lambda *args: allocated.append(args) or empty_quantized(*args))
    outputs, quantized_by_producers = {}, {}
    for in_producers in (True, False):
        monkeypatch.setattr(fp8_linear, "QUANTIZE_IN_PRODUCERS", in_producers)
        allocated.clear()
        llm = LLM(str(aligned_pair[0]), device="cuda", dtype="bfloat16", quantization="fp8",
                  attention_backend="triton", block_size=16, num_kv_blocks=64,
                  enforce_eager=True)
        outputs[in_producers] = llm.generate(prompts, params)
        quantized_by_producers[in_producers] = len(allocated)
        del llm
    assert quantized_by_producers[True] > 0 and quantized_by_producers[False] == 0
    for fused, unfused in zip(outputs[True], outputs[False], strict=True):
        assert fused.token_ids == unfused.token_ids
        assert fused.prompt_logprobs == unfused.prompt_logprobs


def test_a_models_fp8_product_shapes(aligned_pair):
    """Every 2-D FP8 Linear weight's shape and the stacked q_a + kv_a product's; not the
    experts' 3-D stacks (the fused MoE runs those)."""
    from mlaserve.model.fp8_linear import product_shapes

    model = _build(aligned_pair[0], "fp8", load_format="dummy")
    linears = {tuple(p.shape) for p in model.parameters() if p.dtype == FP8_DTYPE
               and p.dim() == 2}
    dense = model.model.layers[0]
    stacks = {tuple(f.weight.shape) for f in (dense.self_attn.q_kv_a, dense.mlp.gate_up)}
    assert stacks.isdisjoint(linears)
    assert product_shapes(model) == linears | stacks



def test_the_fp8_products_whose_input_no_kernel_quantizes(aligned_pair):
    """o_proj reads attention's output as it is: its product is measured with the activation
    quantization it pays; the norms and SiLU-and-mul quantize every other Linear's input."""
    from mlaserve.model.fp8_linear import product_shapes, unquantized_input_shapes

    model = _build(aligned_pair[0], "fp8", load_format="dummy")
    o_proj = {tuple(layer.self_attn.o_proj.weight.shape) for layer in model.model.layers}
    assert unquantized_input_shapes(model) == o_proj and o_proj <= product_shapes(model)
    assert unquantized_input_shapes(_build(aligned_pair[0], "none", load_format="dummy")) \
        == set()  # no FP8 Linears
