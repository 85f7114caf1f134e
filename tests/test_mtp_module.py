"""DeepSeek-V3's multi-token-prediction module (`mlaserve.model.mtp`, `with_mtp=True`).

transformers writes no MTP layer, so the tiny V3 checkpoint gets one here: layer
L = num_hidden_layers in the published layout (a MoE decoder layer shaped like layer L - 1 with
fresh values, enorm, hnorm, eh_proj, shared_head.norm and the copies of the embedding and the
LM head). It loads into `model.mtp` (float32, block-FP8 kept or dequantized, quantized online,
sharded reads); its forward equals a float32 reference: plain torch for the embedding, the
zeroing at position 0, the norms, the concatenation and eh_proj, transformers'
DeepseekV3DecoderLayer (the same tensors) for the decoder layer; missing tensors are named;
without with_mtp the layer is skipped.
"""

import copy
import dataclasses
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from mlaserve.attention.base import MLAShape
from mlaserve.attention.metadata import AttentionMetadata, PrefillChunk
from mlaserve.attention.registry import create_backend
from mlaserve.config import ModelConfig
from mlaserve.distributed import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    expert_parallel,
    init_tensor_parallel,
    parallel_state,
)
from mlaserve.kernels.fp8_blocks import FP8_DTYPE, FP8_MAX, quantize_block_fp8
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.fp8_checkpoint import dequantize_checkpoint, quantize_checkpoint
from mlaserve.model.loader import (
    _cut,
    _cuts,
    build_model,
    checkpoint_name,
    checkpoint_tensor_shapes,
    load_weights,
)
from mlaserve.model.moe_layer import MoE
from mlaserve.model.mtp import SHARED_COPIES
from mlaserve.model.random_checkpoint import write_random_checkpoint
from tests.conftest import CHECKPOINTS, write_checkpoint

NUM_LAYERS = 2  # layer 1 is MoE (first_k_dense_replace=1), and so is the MTP layer 2
MTP = f"model.layers.{NUM_LAYERS}."
CPU = torch.device("cpu")


def _mtp_tensors(tensors: dict[str, torch.Tensor], seed: int = 7) -> dict[str, torch.Tensor]:
    """Layer NUM_LAYERS's tensors as DeepSeek-V3 publishes its MTP layer."""
    gen = torch.Generator().manual_seed(seed)
    last = f"model.layers.{NUM_LAYERS - 1}."
    hidden = tensors["model.norm.weight"].shape[0]

    def draw(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        noise = torch.randn(shape, generator=gen)
        if key.endswith("norm.weight"):
            return 1 + 0.1 * noise
        return 0.05 * noise if key.endswith("e_score_correction_bias") else 0.1 * noise

    out = {MTP + key.removeprefix(last): draw(key, tuple(t.shape))
           for key, t in tensors.items() if key.startswith(last)}
    for name, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                        ("eh_proj.weight", (hidden, 2 * hidden)),
                        ("shared_head.norm.weight", (hidden,))):
        out[MTP + name] = draw(name, shape)
    out[MTP + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    out[MTP + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return out


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """(path, the HF model of the main layers, every checkpoint tensor) of a tiny V3 checkpoint
    with an MTP layer, in float32."""
    arch, overrides, _ = CHECKPOINTS["v3-noaux-lora-yarn-sharded"]
    path = tmp_path_factory.mktemp("v3-mtp")
    hf_model = write_checkpoint(path, arch, {**overrides, "num_hidden_layers": NUM_LAYERS},
                                sharded=False)
    tensors = load_file(path / "model.safetensors")
    tensors |= _mtp_tensors(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path, hf_model, tensors


@pytest.fixture(scope="module")
def fp8_dirs(mtp_checkpoint, tmp_path_factory):
    """(the block-FP8 checkpoint, its dequantized float32 checkpoint)."""
    root = tmp_path_factory.mktemp("v3-mtp-fp8")
    quantize_checkpoint(mtp_checkpoint[0], root / "fp8")
    dequantize_checkpoint(root / "fp8", root / "dequantized", torch.float32)
    return root / "fp8", root / "dequantized"


def _build(path, quantization: str = "auto", with_mtp: bool = True,
           load_format: str = "safetensors") -> DeepseekForCausalLM:
    return build_model(ModelConfig.from_pretrained(path), path, device=CPU, dtype=torch.float32,
                       load_format=load_format, max_positions=64, quantization=quantization,
                       with_mtp=with_mtp)


def _load(path) -> DeepseekForCausalLM:
    """This rank's model with the MTP module, loaded and not yet processed."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(ModelConfig.from_pretrained(path), 64, with_mtp=True)
    model = model.to_empty(device=CPU)
    load_weights(model, path)
    return model


def _stored(tensors: dict[str, torch.Tensor], model: DeepseekForCausalLM,
            name: str) -> torch.Tensor:
    """The checkpoint tensor of parameter `name`: experts stacked as the loader stacks them."""
    key = checkpoint_name(model, name)
    prefix, _, stack = key.rpartition(".")
    if not prefix.endswith(".experts"):
        return tensors[key]
    parts = ("gate_proj", "up_proj") if stack == "gate_up_proj" else ("down_proj",)
    return torch.stack([torch.cat([tensors[f"{prefix}.{e}.{part}.weight"] for part in parts])
                        for e in range(model.config.n_routed_experts)])


def test_the_mtp_layer_loads_into_the_module(mtp_checkpoint):
    path, _, tensors = mtp_checkpoint
    model = _load(path)
    config = model.config
    assert config.is_moe_layer(NUM_LAYERS) and isinstance(model.mtp.mtp_block.mlp, MoE)
    v3 = dataclasses.replace(config, num_hidden_layers=61, first_k_dense_replace=3)
    assert v3.is_moe_layer(61)  # DeepSeek-V3's MTP layer is a MoE layer
    assert model.mtp.layer_idx == NUM_LAYERS and model.num_kv_cache_layers == NUM_LAYERS + 1
    params = dict(model.named_parameters())
    names = [n for n in params if n.startswith("mtp.")]
    assert "mtp.eh_proj.weight" in names and "mtp.mtp_block.mlp.experts.gate_up_proj" in names
    for name in names:
        assert torch.equal(params[name], _stored(tensors, model, name)), name
    # the published layout: every tensor of the layer, the shared copies included
    shapes = checkpoint_tensor_shapes(model)
    assert {k: v for k, v in shapes.items() if k.startswith(MTP)} == {
        k: tuple(t.shape) for k, t in tensors.items() if k.startswith(MTP)}
    # the embedding and the head are the main model's: no second copy
    vocab_shape = tuple(tensors["model.embed_tokens.weight"].shape)
    assert not any(params[n].shape == vocab_shape for n in names)
    processed = _build(path)
    embed = processed.model.embed_tokens
    assert processed.mtp.embed_tokens is embed
    assert processed.mtp.embed_tokens.weight.data_ptr() == embed.weight.data_ptr()
    assert torch.equal(embed.weight, tensors[MTP + "embed_tokens.weight"])


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference(tensors, hf_model, ids: torch.Tensor, positions: torch.Tensor,
               previous: torch.Tensor) -> torch.Tensor:
    """The MTP module's output for one sequence from position 0, in float32 from the raw
    tensors (transformers' DeepseekV3DecoderLayer for the decoder layer)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    hf_config = copy.deepcopy(hf_model.config)
    hf_config._attn_implementation = "eager"
    eps = hf_config.rms_norm_eps
    embeds = tensors["model.embed_tokens.weight"][ids].clone()  # [T, D]
    embeds[positions == 0] = 0
    x = torch.cat((_rms(embeds, tensors[MTP + "enorm.weight"], eps),
                   _rms(previous, tensors[MTP + "hnorm.weight"], eps)), dim=-1)  # [T, 2D]
    x = x @ tensors[MTP + "eh_proj.weight"].T  # [T, D]
    layer = DeepseekV3DecoderLayer(hf_config, NUM_LAYERS).eval()
    state = {}
    for key in layer.state_dict():
        prefix = MTP + "mlp.experts."
        if key == "mlp.experts.gate_up_proj":
            state[key] = torch.stack([torch.cat((tensors[f"{prefix}{e}.gate_proj.weight"],
                                                 tensors[f"{prefix}{e}.up_proj.weight"]))
                                      for e in range(hf_config.n_routed_experts)])
        elif key == "mlp.experts.down_proj":
            state[key] = torch.stack([tensors[f"{prefix}{e}.down_proj.weight"]
                                      for e in range(hf_config.n_routed_experts)])
        else:
            state[key] = tensors[MTP + key]
    layer.load_state_dict(state)
    num_tokens = len(ids)
    mask = torch.full((num_tokens, num_tokens), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        rope = hf_model.model.rotary_emb(x[None], positions[None])
        x = layer(x[None], attention_mask=mask, position_ids=positions[None],
                  position_embeddings=rope)[0]
    return _rms(x, tensors[MTP + "shared_head.norm.weight"], eps)


def _run(model: DeepseekForCausalLM, ids: torch.Tensor, previous: torch.Tensor,
         prefill: int) -> torch.Tensor:
    """The MTP module over ids [T] at positions 0 .. T - 1: the first `prefill` tokens as one
    prefill chunk, then one decode step per token (the torch backend over the MTP layer's own
    paged cache). Returns [T, D]."""
    config = model.config
    block_size, pages = 4, [2, 0, 3, 1]
    slots = [pages[p // block_size] * block_size + p % block_size for p in range(len(ids))]
    cache = torch.zeros(len(pages), block_size, config.kv_cache_dim)
    backend = create_backend("torch", MLAShape(
        num_heads=config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
        qk_rope_head_dim=config.qk_rope_head_dim, block_size=block_size, dtype=torch.float32,
        device=CPU), config.softmax_scale)
    outs = []
    with torch.inference_mode():
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots[:prefill]),
                                 prefills=[PrefillChunk(token_start=0, num_tokens=prefill)])
        outs.append(model.mtp(ids[:prefill], torch.arange(prefill), previous[:prefill], cache,
                              meta))
        for p in range(prefill, len(ids)):
            backend.plan(torch.tensor([pages], dtype=torch.int32),
                         torch.tensor([p + 1], dtype=torch.int32))
            meta = AttentionMetadata(slot_mapping=torch.tensor([slots[p]]), num_decode_tokens=1,
                                     decode_backend=backend)
            outs.append(model.mtp(ids[p:p + 1], torch.tensor([p]), previous[p:p + 1], cache,
                                  meta))
    return torch.cat(outs)


def _inputs(config: ModelConfig, num_tokens: int, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, config.vocab_size, (num_tokens,), generator=gen),
            torch.randn(num_tokens, config.hidden_size, generator=gen))


def test_forward_equals_a_float32_reference(mtp_checkpoint):
    path, hf_model, tensors = mtp_checkpoint
    model = _build(path)
    num_tokens = 11
    ids, previous = _inputs(model.config, num_tokens, seed=3)
    want = _reference(tensors, hf_model, ids, torch.arange(num_tokens), previous)
    got = _run(model, ids, previous, prefill=8)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    logits = model.compute_logits(got)
    torch.testing.assert_close(logits, got @ tensors["lm_head.weight"].T, atol=1e-5, rtol=1e-5)
    # position 0 has no previous token: its embedding is dropped, whatever the token
    other = ids.clone()
    other[0] = (ids[0] + 1) % model.config.vocab_size
    torch.testing.assert_close(_run(model, other, previous, prefill=num_tokens)[0], want[0],
                               atol=1e-5, rtol=1e-5)


def test_block_fp8_checkpoint_loads_kept_dequantized_and_quantized_online(mtp_checkpoint,
                                                                          fp8_dirs):
    path, _, tensors = mtp_checkpoint
    fp8_dir, dequantized_dir = fp8_dirs
    stored = load_file(fp8_dir / "model.safetensors")
    assert stored[MTP + "eh_proj.weight"].dtype == FP8_DTYPE
    for copy_name in SHARED_COPIES:  # the copies stay high precision, as published
        assert stored[MTP + copy_name].dtype == torch.float32
        assert MTP + copy_name + "_scale_inv" not in stored
    kept, dequantized, want = (_build(fp8_dir, "fp8"), _build(fp8_dir, "none"),
                               _build(dequantized_dir))
    kept_params = dict(kept.named_parameters())
    assert kept_params["mtp.eh_proj.weight"].dtype == FP8_DTYPE
    assert torch.equal(kept_params["mtp.eh_proj.weight"].view(torch.uint8),
                       stored[MTP + "eh_proj.weight"].view(torch.uint8))
    assert torch.equal(kept_params["mtp.eh_proj.weight_scale_inv"],
                       stored[MTP + "eh_proj.weight_scale_inv"])
    assert kept_params["mtp.mtp_block.self_attn.o_proj.weight"].dtype == FP8_DTYPE
    want_params = dict(want.named_parameters())
    for name, param in dequantized.named_parameters():
        assert torch.equal(param, want_params[name]), name
    ids, previous = _inputs(kept.config, 6, seed=5)
    expected = _run(want, ids, previous, prefill=4)
    for model in (kept, dequantized):
        torch.testing.assert_close(_run(model, ids, previous, prefill=4), expected,
                                   atol=1e-5, rtol=1e-5)
    online = dict(_build(path, "fp8").named_parameters())  # float32 checkpoint, quantized
    weight, scales = quantize_block_fp8(tensors[MTP + "eh_proj.weight"])
    assert torch.equal(online["mtp.eh_proj.weight"].view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(online["mtp.eh_proj.weight_scale_inv"], scales)


@pytest.mark.parametrize("tp_rank,ep_rank", [(1, None), (1, 1)], ids=["tp2-rank1", "ep2-tp2"])
def test_sharded_reads_are_the_shards(tp_rank, ep_rank, fp8_dirs, monkeypatch):
    """A tensor- / expert-parallel rank's MTP parameters, read from the FP8 checkpoint a shard
    at a time, are its cut of the one-process ones (loading needs no collective)."""
    fp8_dir, dequantized_dir = fp8_dirs
    full = dict(_load(dequantized_dir).named_parameters())
    monkeypatch.setattr(parallel_state, "_tp_group", TensorParallelGroup(rank=tp_rank, size=2))
    if ep_rank is not None:
        monkeypatch.setattr(expert_parallel, "_ep_group",
                            expert_parallel.ExpertParallelGroup(rank=ep_rank, size=2))
    model = _load(fp8_dir)
    cuts = _cuts(model)
    assert "mtp.mtp_block.self_attn.o_proj.weight" in cuts and "mtp.eh_proj.weight" not in cuts
    for name, param in model.named_parameters():
        if name.startswith("mtp."):
            want = full[name] if name not in cuts else _cut(full[name], full[name].shape,
                                                            cuts[name])
            assert torch.equal(param, want), name


def _tp_rank_main(rank: int, store: str, model_dir: str, out_dir: str) -> None:
    """One of two tensor-parallel ranks: its shard of the model and the MTP module's output
    (and logits) over `_inputs`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        init_tensor_parallel(2)
        model = _build(Path(model_dir))
        out = _run(model, *_inputs(model.config, 7, seed=4), prefill=5)
        torch.save({"hidden": out, "logits": model.compute_logits(out)},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_tensor_parallel()
        dist.destroy_process_group()


def test_tensor_parallel_forward_equals_one_process(mtp_checkpoint, tmp_path):
    path = mtp_checkpoint[0]
    mp.spawn(_tp_rank_main, args=(str(tmp_path / "store"), str(path), str(tmp_path)), nprocs=2)
    model = _build(path)
    hidden = _run(model, *_inputs(model.config, 7, seed=4), prefill=5)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["hidden"], hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["logits"], model.compute_logits(hidden), atol=1e-4,
                                   rtol=1e-4)


def test_missing_mtp_tensors_are_named(mtp_checkpoint, fp8_dirs, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(mtp_checkpoint[0], path)
    tensors = load_file(path / "model.safetensors")
    for name in ("eh_proj.weight", "mlp.experts.3.up_proj.weight", "shared_head.norm.weight",
                 *SHARED_COPIES):  # the copies are not needed
        del tensors[MTP + name]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=(
            f"missing 3: {MTP}eh_proj.weight, {MTP}mlp.experts.3.up_proj.weight, "
            f"{MTP}shared_head.norm.weight$")):
        _build(path)
    _build(path, with_mtp=False)  # the main model needs none of them
    fp8_path = tmp_path / "fp8"
    shutil.copytree(fp8_dirs[0], fp8_path)
    tensors = load_file(fp8_path / "model.safetensors")
    del tensors[MTP + "eh_proj.weight_scale_inv"]
    save_file(tensors, fp8_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"missing 1: {MTP}eh_proj.weight_scale_inv "
                                         r"\(the scales of FP8 weight"):
        _build(fp8_path, "fp8")


def test_without_mtp_the_layer_is_skipped_and_a_config_without_it_is_refused(
        mtp_checkpoint, checkpoint_dir):
    path, _, tensors = mtp_checkpoint
    model = _build(path, with_mtp=False)
    assert model.mtp is None
    assert model.num_kv_cache_layers == NUM_LAYERS
    assert not any(name.startswith("mtp.") for name, _ in model.named_parameters())
    assert not any(key.startswith(MTP) for key in checkpoint_tensor_shapes(model))
    v2 = ModelConfig.from_pretrained(checkpoint_dir("v2-greedy-nolora-untied")[0])
    assert v2.num_nextn_predict_layers == 0
    message = "this checkpoint has no multi-token-prediction \\(MTP\\) layer"
    with pytest.raises(ValueError, match=message), torch.device("meta"):
        DeepseekForCausalLM(v2, 64, with_mtp=True)
    with pytest.raises(ValueError, match=message):
        build_model(v2, None, device=CPU, dtype=torch.float32, load_format="dummy",
                    max_positions=64, with_mtp=True)


def test_dummy_weights_fill_the_module(mtp_checkpoint):
    path = mtp_checkpoint[0]
    for quantization in ("auto", "fp8"):
        model = _build(path, quantization, load_format="dummy")
        params = {n: p for n, p in model.named_parameters() if n.startswith("mtp.")}
        for name, param in params.items():
            if name.endswith("norm.weight"):
                assert torch.equal(param, torch.ones_like(param)), name
            elif name.endswith("e_score_correction_bias"):
                assert not param.any(), name
            elif name.endswith("_scale_inv"):
                assert (param == 0.02 / FP8_MAX).all(), name
            else:
                values = param.float()
                bound = FP8_MAX if param.dtype == FP8_DTYPE else 0.02
                assert values.abs().max() <= bound and values.std() > bound / 10, name
        assert (params["mtp.eh_proj.weight"].dtype == FP8_DTYPE) == (quantization == "fp8")
        out = _run(model, *_inputs(model.config, 5, seed=1), prefill=3)
        assert out.isfinite().all()


def test_random_checkpoint_writes_the_mtp_layer(mtp_checkpoint, tmp_path):
    shutil.copy(mtp_checkpoint[0] / "config.json", tmp_path / "config.json")
    write_random_checkpoint(tmp_path, seed=2, dtype=torch.float32)
    written = {}
    for file in tmp_path.glob("*.safetensors"):
        written |= load_file(file)
    assert {k for k in written if k.startswith(MTP)} == {
        k for k in mtp_checkpoint[2] if k.startswith(MTP)}
    model = _build(tmp_path)  # loads with nothing missing or unexpected
    assert torch.equal(model.mtp.enorm.weight, written[MTP + "enorm.weight"])
