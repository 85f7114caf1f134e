"""DeepSeek block-FP8 checkpoints: the format, loading as published (weight-only dequantized,
or kept FP8 in the Linear layers), sharded reads under tensor / expert parallelism, and the
errors. FP8 experts, FP8 shards and FP8 dummy weights: tests/test_fp8_weights.py."""

import argparse
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.cli import add_engine_arguments, engine_args_from
from mlaserve.config import FP8_QUANTIZATION_CONFIG, ModelConfig
from mlaserve.distributed import TensorParallelGroup, expert_parallel, parallel_state
from mlaserve.engine.args import EngineArgs
from mlaserve.kernels.fp8_blocks import FP8_DTYPE, FP8_MAX, dequantize_block_fp8, quantize_block_fp8
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.fp8 import Fp8WeightSlice, keep_fp8_weights
from mlaserve.model.fp8_checkpoint import dequantize_checkpoint, quantize_checkpoint
from mlaserve.model.loader import _cut, _cuts, build_model, load_weights
from tests.conftest import CHECKPOINTS, read_config, write_checkpoint

PROMPTS = [[0, 5, 17, 42, 99, 3, 250, 7], [0, 200, 1, 13]]
HIGH_PRECISION = ("embed_tokens.weight", "lm_head.weight", "norm.weight", "mlp.gate.weight",
                  "e_score_correction_bias")


def test_block_quantization_round_trip_and_partial_blocks(tmp_path):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 260, generator=gen)  # 3 x 3 blocks, the last ones partial
    weight[128:256, :128] = 0  # an all-zero block
    fp8, scale_inv = quantize_block_fp8(weight)
    assert fp8.dtype == FP8_DTYPE and fp8.shape == (300, 260)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 3)
    assert torch.equal(scale_inv[0, 0], weight[:128, :128].abs().amax() / FP8_MAX)
    assert torch.equal(scale_inv[2, 2], weight[256:, 256:].abs().amax() / FP8_MAX)
    assert scale_inv[1, 0] == 1 and not fp8[128:256, :128].float().any()
    assert fp8[256:, 256:].float().abs().max() == FP8_MAX  # each block's amax maps to 448
    full = dequantize_block_fp8(fp8, scale_inv)  # [300, 260] float32
    stack_fp8, stack_scales = quantize_block_fp8(torch.stack((weight, -weight)))  # a stack:
    assert stack_scales.shape == (2, 3, 3) and torch.equal(stack_scales[1], scale_inv)
    assert torch.equal(stack_fp8[0].view(torch.uint8), fp8.view(torch.uint8))  # per matrix
    assert torch.equal(stack_fp8[1].float(), -fp8.float())
    block_amax = scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    assert ((full - weight).abs() <= block_amax * 448 / 16).all()  # e4m3: 3 mantissa bits
    save_file({"w": fp8, "s": scale_inv}, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        lazy = Fp8WeightSlice(handle.get_slice("w"), handle.get_slice("s"), (300, 260),
                              torch.device("cpu"))
        assert torch.equal(lazy.full(), full)
        for rows, cols in [(slice(100, 150), slice(None)), (slice(None), slice(127, 129)),
                           (slice(255, 300), slice(5, 260)), (slice(7, 7), slice(None))]:
            assert torch.equal(lazy[rows, cols], full[rows, cols]), (rows, cols)
        assert torch.equal(lazy[130:140], full[130:140])


@pytest.fixture(scope="module")
def fp8_pair(checkpoint_dir, tmp_path_factory):
    """name -> (FP8 checkpoint in the published layout, its dequantized float32 checkpoint)."""
    cache = {}

    def make(name: str):
        if name not in cache:
            root = tmp_path_factory.mktemp(f"fp8-{name}")
            quantize_checkpoint(checkpoint_dir(name)[0], root / "fp8")
            dequantize_checkpoint(root / "fp8", root / "dequantized", torch.float32)
            cache[name] = (root / "fp8", root / "dequantized")
        return cache[name]

    return make


def _tensors(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


@pytest.mark.parametrize("name", ["v2-greedy-nolora-untied", "v3-noaux-lora-yarn-sharded"])
def test_fp8_checkpoint_matches_its_dequantized_model(name, checkpoint_dir, fp8_pair):
    fp8_dir, dequantized_dir = fp8_pair(name)
    assert read_config(fp8_dir)["quantization_config"] == FP8_QUANTIZATION_CONFIG
    tensors, original = _tensors(fp8_dir), _tensors(checkpoint_dir(name)[0])
    for key, tensor in original.items():  # the published layout: which tensors are FP8
        if key.endswith(HIGH_PRECISION):
            assert torch.equal(tensors[key], tensor) and key + "_scale_inv" not in tensors, key
        else:
            rows, cols = tensor.shape
            assert tensors[key].dtype == FP8_DTYPE, key
            assert tensors[key + "_scale_inv"].shape == (-(-rows // 128), -(-cols // 128)), key
    if (fp8_dir / "model.safetensors.index.json").is_file():
        index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(tensors)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    outs = {}
    for label, path, quantization in [("auto", fp8_dir, "auto"), ("none", fp8_dir, "none"),
                                      ("fp8", fp8_dir, "fp8"),
                                      ("dequantized", dequantized_dir, "auto")]:
        llm = LLM(str(path), device="cpu", num_kv_blocks=16, block_size=16,
                  quantization=quantization)
        outs[label] = llm.generate(PROMPTS, params)
    for label in ("auto", "none", "fp8"):  # fp8: FP8 Linear weights, dequantized per GEMM
        for got, want in zip(outs[label], outs["dequantized"], strict=True):
            assert got.token_ids == want.token_ids
            for got_pos, want_pos in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:],
                                         strict=True):
                assert got_pos.keys() == want_pos.keys()
                for token, logprob in want_pos.items():
                    assert abs(got_pos[token] - logprob) <= 1e-4


def _load(config: ModelConfig, path) -> DeepseekForCausalLM:
    """This rank's model (the groups as patched), its weights loaded and not yet processed."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, 64)
    model = model.to_empty(device="cpu")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, path)
    return model


@pytest.fixture(scope="module")
def straddling_pair(tmp_path_factory):
    """A V3 checkpoint whose shards under TP 2 start inside a 128-block (dense intermediate
    320: rank 1's rows from 160; expert intermediate 160: from 80 to 160), as FP8 and
    dequantized."""
    arch, overrides, _ = CHECKPOINTS["v3-noaux-lora-yarn-sharded"]
    root = tmp_path_factory.mktemp("fp8-straddling")
    write_checkpoint(root / "bf16", arch, {**overrides, "num_hidden_layers": 2,
                                           "intermediate_size": 320,
                                           "moe_intermediate_size": 160}, sharded=True)
    quantize_checkpoint(root / "bf16", root / "fp8")
    dequantize_checkpoint(root / "fp8", root / "dequantized", torch.float32)
    return root / "fp8", root / "dequantized"


@pytest.mark.parametrize("tp_rank,ep_rank", [(1, None), (0, 1), (1, 1)],
                         ids=["tp2-rank1", "ep2-rank1-tp2-rank0", "ep2-rank1-tp2-rank1"])
def test_sharded_fp8_reads_are_the_shards_of_the_dequantized_weights(
        tp_rank, ep_rank, straddling_pair, monkeypatch):
    """Each tensor- / expert-parallel rank's parameters, read from the FP8 checkpoint a shard
    at a time, equal its cut of the one-process parameters of the dequantized checkpoint
    (loading needs no collective, so the rank's groups are patched in)."""
    fp8_dir, dequantized_dir = straddling_pair
    config = ModelConfig.from_pretrained(fp8_dir)
    full = dict(_load(config, dequantized_dir).named_parameters())
    monkeypatch.setattr(parallel_state, "_tp_group", TensorParallelGroup(rank=tp_rank, size=2))
    if ep_rank is not None:
        monkeypatch.setattr(expert_parallel, "_ep_group",
                            expert_parallel.ExpertParallelGroup(rank=ep_rank, size=2))
    model = _load(config, fp8_dir)
    cuts = _cuts(model)
    for name, param in model.named_parameters():
        want = full[name] if name not in cuts else _cut(full[name], full[name].shape, cuts[name])
        assert torch.equal(param, want), name


def test_a_scale_in_another_file_than_its_weight(straddling_pair, tmp_path):
    """Sharded checkpoints may store a weight and its scale in different files: the loader
    and the dequantizing tool find it through the index."""
    fp8_dir, dequantized_dir = straddling_pair
    path = tmp_path / "moved"
    shutil.copytree(fp8_dir, path)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    files = sorted(set(index["weight_map"].values()))
    source = index["weight_map"][name]
    target = next(f for f in files if f != source)
    moved = load_file(path / source)
    scale = moved.pop(name)
    save_file(moved, path / source)
    save_file(load_file(path / target) | {name: scale}, path / target)
    index["weight_map"][name] = target
    index_file.write_text(json.dumps(index))
    config = ModelConfig.from_pretrained(path)
    want = dict(_load(config, dequantized_dir).named_parameters())
    for param_name, param in _load(config, path).named_parameters():
        assert torch.equal(param, want[param_name]), param_name
    dequantize_checkpoint(path, tmp_path / "dequantized", torch.float32)
    got, want_tensors = _tensors(tmp_path / "dequantized"), _tensors(dequantized_dir)
    assert got.keys() == want_tensors.keys()
    assert all(torch.equal(got[key], want_tensors[key]) for key in got)


def _rewrite(path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_bad_scales_are_listed_in_the_one_error(fp8_pair, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(fp8_pair("v2-greedy-nolora-untied")[0], path)

    def edit(t):
        del t["model.layers.0.self_attn.o_proj.weight_scale_inv"]
        t["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"] = torch.ones(2, 1)
        t["model.norm.weight_scale_inv"] = torch.ones(1)
        del t["model.layers.2.mlp.experts.5.down_proj.weight"]  # its scale is left alone

    _rewrite(path, edit)
    with pytest.raises(ValueError) as info:
        LLM(str(path), device="cpu", num_kv_blocks=8)
    message = str(info.value)
    assert "missing 2: model.layers.0.self_attn.o_proj.weight_scale_inv (the scales of FP8 " \
           "weight model.layers.0.self_attn.o_proj.weight), " \
           "model.layers.2.mlp.experts.5.down_proj.weight;" in message
    assert ("wrong shape 1: model.layers.1.self_attn.kv_b_proj.weight_scale_inv: checkpoint "
            "(2, 1), model (1, 1) (FP8 weight (128, 32) in 128x128 blocks)") in message
    assert ("unexpected 2: model.layers.2.mlp.experts.5.down_proj.weight_scale_inv, "
            "model.norm.weight_scale_inv (its weight is not FP8)") in message


def test_fused_expert_layout_in_fp8_is_refused(fp8_pair, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(fp8_pair("v2-greedy-nolora-untied")[0], path)
    prefix = "model.layers.1.mlp.experts"
    _rewrite(path, lambda t: t.update(
        {f"{prefix}.gate_up_proj": torch.zeros(8, 64, 64).to(FP8_DTYPE)}))
    with pytest.raises(ValueError, match="fused-experts layout .*gate_up_proj.* no published"):
        LLM(str(path), device="cpu", num_kv_blocks=8)


@pytest.mark.parametrize("edit,match", [
    ({"quant_method": "awq"}, "quantization_config.quant_method = 'awq' is not supported"),
    ({"fmt": "e5m2"}, "quantization_config.fmt = 'e5m2' is not supported"),
    ({"weight_block_size": [64, 64]}, r"weight_block_size = \[64, 64\] is not supported"),
    ({"weight_block_size": None}, "weight_block_size = None is not supported"),
    ({"activation_scheme": "static"}, "activation_scheme = 'static' is not supported"),
])
def test_bad_quantization_config_says_what_is_supported(checkpoint_dir, edit, match):
    raw = read_config(checkpoint_dir("v2-greedy-nolora-untied")[0])
    raw["quantization_config"] = {**FP8_QUANTIZATION_CONFIG, **edit}
    with pytest.raises(ValueError, match=match) as info:
        ModelConfig.from_dict(raw)
    assert '"weight_block_size": [128, 128]' in str(info.value)  # names what is supported
    raw["quantization_config"] = "fp8"
    with pytest.raises(ValueError, match="must be an object or null"):
        ModelConfig.from_dict(raw)


def test_quantization_option(fp8_pair):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_args_from(parser.parse_args(["--quantization", "none"])).quantization == "none"
    assert engine_args_from(parser.parse_args([])).quantization == "auto"
    with pytest.raises(ValueError, match="unknown quantization 'fp4'; use one of auto, none, fp8"):
        EngineArgs(quantization="fp4")
    config = ModelConfig.from_pretrained(fp8_pair("v2-greedy-nolora-untied")[0])
    assert config.quant_method == "fp8" and config.weight_block_size == (128, 128)


def _build(path, quantization: str, load_format: str = "safetensors") -> DeepseekForCausalLM:
    return build_model(ModelConfig.from_pretrained(path), path, device=torch.device("cpu"),
                       dtype=torch.float32, load_format=load_format, max_positions=64,
                       quantization=quantization)


@pytest.mark.parametrize("name", ["v2-greedy-nolora-untied", "v3-noaux-lora-yarn-sharded"])
def test_fp8_linears_hold_the_checkpoint_tensors(name, fp8_pair):
    """With the FP8 path on, every Linear but kv_b_proj holds the checkpoint's FP8 weight and
    scales as stored; kv_b_proj, the experts and the high-precision tensors are those of the
    dequantized checkpoint."""
    fp8_dir, dequantized_dir = fp8_pair(name)
    stored, dequantized = _tensors(fp8_dir), _tensors(dequantized_dir)
    model = _build(fp8_dir, "fp8")
    params = dict(model.named_parameters())
    kept = {n for n, p in params.items() if p.dtype == FP8_DTYPE}
    assert kept == {n for n, t in stored.items() if t.dtype == FP8_DTYPE
                    and ".kv_b_proj." not in n and ".mlp.experts." not in n
                    and ".shared_experts." not in n}
    for param_name in kept:
        scale_name = param_name + "_scale_inv"
        assert torch.equal(params[param_name].view(torch.uint8),
                           stored[param_name].view(torch.uint8)), param_name
        assert torch.equal(params[scale_name], stored[scale_name]), scale_name
    kv_b = [n for n in params if n.endswith("kv_b_proj.weight")]
    assert kv_b and all(params[n].dtype == torch.float32 for n in kv_b)
    for param_name, param in params.items():
        if param_name in dequantized and param_name not in kept:  # kv_b_proj, norms, router,
            # embeddings, LM head
            assert torch.equal(param, dequantized[param_name]), param_name


def test_fp8_path_decision_and_the_fused_projection_pads_to_scale_blocks(fp8_pair):
    cpu = torch.device("cpu")
    assert not keep_fp8_weights("fp8", "auto", cpu)  # no FP8 tensor cores
    assert not keep_fp8_weights("fp8", "none", cpu)
    assert keep_fp8_weights("fp8", "fp8", cpu)
    assert not keep_fp8_weights(None, "auto", cpu)  # a high-precision checkpoint stays so
    assert keep_fp8_weights(None, "fp8", cpu)  # ... unless asked: quantized as it loads
    # q_a_proj (32 rows) and kv_a_proj_with_mqa (48 rows) run as one GEMM: q_a padded to 128
    attention = _build(fp8_pair("v3-noaux-lora-yarn-sharded")[0], "fp8").model.layers[0].self_attn
    fused = attention.q_kv_a
    assert fused.weight.shape == (128 + 48, 64) and fused.weight_scale_inv.shape == (2, 1)
    assert not fused.weight[32:128].float().any()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    want = torch.cat([x @ dequantize_block_fp8(m.weight, m.weight_scale_inv).T
                      for m in (attention.q_a_proj, attention.kv_a_proj_with_mqa)], dim=-1)
    torch.testing.assert_close(fused(x), want, rtol=0, atol=1e-6)
