"""Loader errors, config validation, dummy weights and argument errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.config import ModelConfig
from tests.conftest import read_config

NAME = "v2-greedy-nolora-untied"


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_one_error_lists_missing_unexpected_and_wrong_shape(checkpoint_dir, tmp_path):
    src, _ = checkpoint_dir(NAME)
    path = copy_checkpoint(src, tmp_path / "ckpt")

    def edit(t):
        del t["model.layers.0.self_attn.o_proj.weight"]
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
        t["model.layers.0.self_attn.surprise.weight"] = torch.zeros(2)
        t["model.norm.weight"] = torch.ones(7)

    rewrite(path, edit)
    with pytest.raises(ValueError) as info:
        LLM(str(path), device="cpu", num_kv_blocks=8)
    message = str(info.value)
    assert "missing 2" in message
    assert "model.layers.0.self_attn.o_proj.weight" in message
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in message
    assert "unexpected 1: model.layers.0.self_attn.surprise.weight" in message
    assert "wrong shape 1: model.norm.weight: checkpoint (7,), model (64,)" in message


def test_fp8_scale_of_a_high_precision_weight_and_dummy_fp8_config(checkpoint_dir, tmp_path):
    """FP8 checkpoints load (tests/test_fp8_loading.py); a `weight_scale_inv` beside a weight
    that is not FP8 is reported as unexpected, and dummy weights of an FP8 config are drawn in
    the model dtype."""
    src, _ = checkpoint_dir(NAME)
    path = copy_checkpoint(src, tmp_path / "ckpt")
    rewrite(path, lambda t: t.update(
        {"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)}))
    with pytest.raises(ValueError, match="unexpected 1: model.layers.0.self_attn.o_proj."
                                         "weight_scale_inv \\(its weight is not FP8\\)"):
        LLM(str(path), device="cpu", num_kv_blocks=8)
    config = read_config(path)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), device="cpu", num_kv_blocks=8, load_format="dummy")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0,
                                                   ignore_eos=True))[0]
    assert len(out.token_ids) == 2


def test_mtp_layers_are_skipped(checkpoint_dir, tmp_path):
    src, _ = checkpoint_dir(NAME)
    path = copy_checkpoint(src, tmp_path / "ckpt")
    params = SamplingParams(max_tokens=4, temperature=0)
    before = LLM(str(path), device="cpu", num_kv_blocks=8).generate([[3, 4, 5]], params)
    n = read_config(path)["num_hidden_layers"]
    rewrite(path, lambda t: t.update({
        f"model.layers.{n}.eh_proj.weight": torch.zeros(4, 4),
        f"model.layers.{n}.self_attn.o_proj.weight": torch.zeros(3, 3)}))
    after = LLM(str(path), device="cpu", num_kv_blocks=8).generate([[3, 4, 5]], params)
    assert before[0].token_ids == after[0].token_ids


def test_missing_weights_and_config(tmp_path, checkpoint_dir):
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")
    src, _ = checkpoint_dir(NAME)
    path = copy_checkpoint(src, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        LLM(str(path), device="cpu", num_kv_blocks=8)
    # Dummy weights need no weight files: the model loads and generates every token asked for.
    llm = LLM(str(path), device="cpu", num_kv_blocks=8, load_format="dummy")
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    out = llm.generate([[1, 2, 3]], params)[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 3
    vocab_size = read_config(path)["vocab_size"]
    assert all(isinstance(t, int) and 0 <= t < vocab_size for t in out.token_ids)


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "llama", "model_type 'llama' is not supported"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("topk_method", "sparse", "topk_method='sparse' is not supported"),
    ("n_group", 3, "not divisible by n_group=3"),
    ("kv_lora_rank", 0, "'kv_lora_rank' = 0 must be > 0"),
    ("hidden_size", "64", "'hidden_size' = '64' has the wrong type"),
    ("rope_scaling", {"type": "linear", "factor": 2}, "rope_scaling type 'linear'"),
    ("rope_scaling", {"type": "yarn", "factor": -4, "original_max_position_embeddings": 256},
     r"factor \(-4.0\) and original_max_position_embeddings \(256\) must be > 0"),
    ("rope_scaling", {"type": "yarn", "factor": "big", "original_max_position_embeddings": 256},
     "yarn rope_scaling has a field of the wrong type"),
    ("qk_rope_head_dim", 63, "qk_rope_head_dim = 63 must be even"),
    ("rms_norm_eps", -1e-6, "'rms_norm_eps' = -1e-06 must be > 0"),
])
def test_config_errors_name_field_and_value(checkpoint_dir, field, value, match):
    src, _ = checkpoint_dir(NAME)
    raw = read_config(src)
    raw.pop("rope_parameters", None)
    raw[field] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)


def test_config_reads_both_rope_layouts_and_v3_scale():
    raw = {"model_type": "deepseek_v3", "vocab_size": 8, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
           "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "rope_theta": 10000,
           "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                            "mscale_all_dim": 1.0}}
    config = ModelConfig.from_dict(raw)
    # V3's scale (docs/architecture.md, "MLA conventions")
    assert abs(config.softmax_scale - 0.13523) < 1e-5
    raw["rope_parameters"] = {**raw.pop("rope_scaling"), "rope_type": "yarn", "rope_theta": 50.0}
    config = ModelConfig.from_dict(raw)
    assert config.rope_theta == 50.0 and config.rope_scaling.factor == 40


def test_argument_errors_say_what_to_change():
    llm = LLM(device="cpu", num_kv_blocks=16, block_size=16, max_model_len=64)
    with pytest.raises(ValueError,
                       match=r"max_tokens must be an integer in \[1, 2\*\*63 - 1\], got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="more than max_model_len=64"):
        llm.generate([[5] * 65])
    with pytest.raises(ValueError, match="lower max_tokens or raise max_model_len"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        LLM(device="cpu", attention_backend="fast")
    with pytest.raises(ValueError, match="CUTLASS MLA is not bundled"):
        LLM(device="cpu", attention_backend="CUTLASS_MLA")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        LLM(device="tpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        LLM(device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM(device="cpu", max_num_sequences=3)
    # the engine still works after the rejected requests
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_demo_model_generates_from_strings_and_ids():
    llm = LLM(device="cpu", num_kv_blocks=64, block_size=16)
    text_out, ids_out = llm.generate(["Hello world", [7, 8, 9]],
                                     SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    bos = llm.tokenizer.bos_token_id
    assert text_out.prompt_token_ids[0] == bos  # string prompts get the tokenizer's BOS
    assert ids_out.prompt_token_ids == [7, 8, 9]  # token ids are taken literally
    assert len(text_out.token_ids) == 5 and text_out.outputs[0].text == text_out.text
    assert text_out.text == llm.tokenizer.decode(text_out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("share", [0, 1.5, -0.1])
def test_gpu_memory_utilization_is_a_share(share):
    from mlaserve.engine.args import EngineArgs

    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineArgs(gpu_memory_utilization=share)


def test_max_model_len_past_the_trained_positions_is_refused_unless_allowed(monkeypatch):
    from mlaserve.config import ModelConfig
    from mlaserve.engine.args import DEMO_MODEL_DIR, EngineArgs
    from mlaserve.engine.engine_config import ALLOW_LONG_MAX_MODEL_LEN_ENV, resolve_max_model_len

    config = ModelConfig.from_pretrained(DEMO_MODEL_DIR)  # max_position_embeddings 1024
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)
    assert resolve_max_model_len(EngineArgs(), config) == 1024
    assert resolve_max_model_len(EngineArgs(max_model_len=512), config) == 512
    with pytest.raises(ValueError, match="max_model_len 2048 is more than the model's "
                                         r"max_position_embeddings \(1024\)"):
        resolve_max_model_len(EngineArgs(max_model_len=2048), config)
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
    assert resolve_max_model_len(EngineArgs(max_model_len=2048), config) == 2048
