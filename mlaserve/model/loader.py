"""Build a model on the target device and fill it from HF safetensors (or with dummy weights).

Checkpoint tensors are streamed one at a time (a progress bar counts them). Every missing,
unexpected or wrongly shaped tensor is collected and reported in one error. Multi-token-prediction
layers (index >= num_hidden_layers) are skipped on purpose. FP8 block-quantized checkpoints
(`weight_scale_inv`) are refused with a clear message.

Under tensor parallelism (the model built for a group of size N > 1) each rank reads only its
shard of every split tensor, and under expert parallelism only its experts (the `ShardSpec`s
of the parameter, through safetensors `get_slice`), so no rank reads or holds the whole
checkpoint; shapes are checked against the full tensor. Dummy weights are drawn in full, one
tensor at a time, and cut to the rank's part, so they equal the parts of the N = 1 dummy
weights of the same seed (at the cost of one full tensor of transient memory per rank while
drawing).
"""

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from mlaserve.config import ModelConfig
from mlaserve.distributed import get_tp_group
from mlaserve.distributed.expert_parallel import get_ep_group
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.layers import RMSNorm, RotaryEmbedding
from mlaserve.model.parallel_linear import ShardSpec, tensor_parallel_shards

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\."
                     r"(?P<part>gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FP8_MESSAGE = ("FP8 block-quantized checkpoints (weight_scale_inv) are not supported yet: use a "
                "bf16 checkpoint (e.g. converted with DeepSeek's fp8_cast_bf16.py), or "
                "--load-format dummy for benchmarks")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory: the sharded index's files, or the one file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names shards that are missing: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files; pass a directory with HF "
                         "safetensors weights, or load_format='dummy' for random weights")
    return files


def _expected_tensors(model: DeepseekForCausalLM
                      ) -> tuple[dict[str, tuple[str, int | None, str]], set[str]]:
    """Checkpoint name -> (parameter name, local expert index or None, part) for every tensor
    this rank needs, and the names of the experts other expert-parallel ranks own."""
    expected, elsewhere = {}, set()
    num_experts = model.config.n_routed_experts
    for name, param in model.named_parameters():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            prefix = name.rsplit(".", 1)[0]
            first = model.get_submodule(prefix).first_expert
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            for e in range(num_experts):
                local = e - first
                for part in parts:
                    key = f"{prefix}.{e}.{part}.weight"
                    if 0 <= local < param.shape[0]:
                        expected[key] = (name, local, part)
                    else:
                        elsewhere.add(key)
        else:
            expected[name] = (name, None, "")
    return expected, elsewhere


Cut = tuple[ShardSpec, int, int]  # how to cut, this rank's index, the group's size


def _cuts(model: DeepseekForCausalLM) -> dict[str, list[Cut]]:
    """Parameter name -> the cuts that make this rank's parameter from the full tensor, in
    order: its expert-parallel experts of a stack, then its tensor-parallel columns."""
    tp, ep = model.tp, get_ep_group()
    cuts: dict[str, list[Cut]] = {}
    if ep.size > 1:
        for prefix, module in model.named_modules():
            for name, spec in getattr(module, "ep_shards", {}).items():
                cuts.setdefault(f"{prefix}.{name}", []).append((spec, ep.rank, ep.size))
    if tp.size > 1:
        for name, spec in tensor_parallel_shards(model).items():
            cuts.setdefault(name, []).append((spec, tp.rank, tp.size))
    return cuts


def _full_shape(local_shape: tuple[int, ...], cuts: list[Cut]) -> tuple[int, ...]:
    shape = tuple(local_shape)
    for spec, _, size in cuts:
        shape = spec.full_shape(shape, size)
    return shape


def _cut(source, full_shape: tuple[int, ...], cuts: list[Cut]) -> torch.Tensor:
    """This rank's part of `source` (a tensor or a safetensors slice of shape full_shape)."""
    shape = full_shape
    for spec, rank, size in cuts:
        source = spec.take(source, shape, rank, size)
        shape = tuple(source.shape)
    return source


def _target(param: torch.Tensor, spec: ShardSpec | None, expert: int | None,
            part: str) -> tuple[torch.Tensor, ShardSpec | None]:
    """The part of `param` one checkpoint tensor fills, and how that tensor is sharded."""
    if expert is None:
        return param, spec
    if spec is not None:  # an expert's [I, D] gate / up or [D, I] down: one piece, one dim less
        spec = ShardSpec(spec.dim - 1)
    if part == "down_proj":
        return param[expert], spec
    half = param.shape[1] // 2
    return (param[expert, :half] if part == "gate_proj" else param[expert, half:]), spec


def load_weights(model: DeepseekForCausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor (this rank's shard of it) into its parameter; one
    ValueError lists all problems."""
    config, tp = model.config, model.tp
    params = dict(model.named_parameters())
    shards = tensor_parallel_shards(model) if tp.size > 1 else {}
    cuts = _cuts(model)
    expected, elsewhere = _expected_tensors(model)
    pending = set(expected)
    unexpected: list[str] = []
    wrong_shape: list[str] = []
    files = checkpoint_files(model_dir)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", leave=False,
              disable=None) as bar:
        for handle in handles:
            for key in handle.keys():
                bar.update(1)
                if key.endswith("weight_scale_inv") or key.endswith("weight_scale"):
                    raise ValueError(f"{model_dir}: {_FP8_MESSAGE}")
                layer = _LAYER.match(key)
                if layer and int(layer.group(1)) >= config.num_hidden_layers:
                    continue  # multi-token-prediction layers are not used for decoding
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                if config.tie_word_embeddings and key == "lm_head.weight":
                    continue
                if key in elsewhere:
                    continue  # an expert another expert-parallel rank owns
                fused = key.endswith(".mlp.experts.gate_up_proj") or key.endswith(
                    ".mlp.experts.down_proj")
                if fused and key in params:  # stacked experts: this rank's part of the stack
                    targets = [n for n, (p, _, _) in expected.items() if p == key]
                    target, key_cuts = params[key], cuts.get(key, [])
                elif key in expected:
                    targets = [key]
                    name, expert, part = expected[key]
                    target, spec = _target(params[name], shards.get(name), expert, part)
                    key_cuts = [] if spec is None else [(spec, tp.rank, tp.size)]
                else:
                    unexpected.append(key)
                    continue
                source = handle.get_slice(key)
                if source.get_dtype().startswith("F8"):
                    raise ValueError(f"{model_dir}: {_FP8_MESSAGE}")
                shape = tuple(source.get_shape())
                full_shape = _full_shape(target.shape, key_cuts)
                if shape != full_shape:
                    wrong_shape.append(f"{key}: checkpoint {shape}, model {full_shape}")
                    pending.difference_update(targets)  # reported once, as wrong shape
                    continue
                if key_cuts:  # reads this rank's rows / columns only
                    tensor = _cut(source, shape, key_cuts)
                else:
                    tensor = handle.get_tensor(key)
                with torch.no_grad():
                    target.copy_(tensor)
                pending.difference_update(targets)
    problems = []
    if pending:
        problems.append(f"missing {len(pending)}: {_listing(pending)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_listing(unexpected)}")
    if wrong_shape:
        problems.append(f"wrong shape {len(wrong_shape)}: {_listing(wrong_shape)}")
    if problems:
        raise ValueError(f"checkpoint {model_dir} does not match its config.json: "
                         + "; ".join(problems))


def _listing(names, limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def init_dummy_weights(model: DeepseekForCausalLM, seed: int) -> None:
    """Random weights from the config alone: small uniform values, norms at one. A split
    parameter gets its shard of the full tensor drawn with the same generator state, so every
    tensor- or expert-parallel size yields shards of the same model."""
    cuts = _cuts(model)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                continue
            if name.endswith("e_score_correction_bias"):
                param.zero_()
                continue
            if name not in cuts:
                param.uniform_(-0.02, 0.02, generator=generator)
                continue
            full_shape = _full_shape(param.shape, cuts[name])
            full = param.new_empty(full_shape).uniform_(-0.02, 0.02, generator=generator)
            param.copy_(_cut(full, full_shape, cuts[name]))


def build_model(config: ModelConfig, model_dir: Path | None, *, device: torch.device,
                dtype: torch.dtype, load_format: str, max_positions: int,
                seed: int = 0) -> DeepseekForCausalLM:
    """Allocate the model directly on `device` in `dtype`, then load or randomise its weights.

    Under tensor parallelism (`mlaserve.distributed.init_tensor_parallel` called before) the
    model is this rank's shard; every rank of the group calls this with the same arguments.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format '{load_format}'; use one of {LOAD_FORMATS}")
    config.check_tensor_parallel_size(get_tp_group().size)
    if load_format != "dummy" and config.quant_method == "fp8":
        raise ValueError(f"{model_dir}: {_FP8_MESSAGE}")
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, max_positions)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build(device)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, Path(model_dir))
    model.process_weights_after_loading()
    model.requires_grad_(False)
    return model.eval()
