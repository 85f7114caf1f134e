"""Build a model on the target device and fill it from HF safetensors (or with dummy weights).

Checkpoint tensors are streamed one at a time (a progress bar counts them). Every missing,
unexpected or wrongly shaped tensor is collected and reported in one error. Multi-token-prediction
layers (index >= num_hidden_layers) are skipped on purpose, unless the model is built with its
MTP module (`build_model(with_mtp=True)`, `mlaserve.model.mtp`): then layer num_hidden_layers
loads into it like any layer (FP8, online quantization and shards alike, the checkpoint names
mapped to the module's by `DeepseekForCausalLM.parameter_name` / `checkpoint_name`), except its
copies of the embedding and the LM head, which are the main model's.

DeepSeek's block-FP8 checkpoints (`mlaserve.model.fp8`) load as published: which tensors are
FP8 follows the checkpoint (a float8_e4m3fn `X.weight` with its float32 `X.weight_scale_inv`,
whose shape is checked and which is reported missing like any tensor). Where the model keeps
FP8 Linear weights (`keep_fp8_weights` decides, from `--quantization` and the device; the
layers are `mlaserve.model.fp8_linear`'s), the FP8 weight and its scales are copied as stored
(this rank's rows / columns, or its experts, and the scale blocks that cover them); every
other FP8 weight (all of them with `--quantization none`; kv_b_proj always; the experts where
their I is not whole 128-blocks) is dequantized weight-only into the model's dtype as it is
read, again only its shard. A high-precision weight that the model keeps FP8 (`--quantization
fp8` on a bf16 checkpoint) is quantized as it is read, its shard in 128x128 blocks as
`quantize_block_fp8` quantizes a published checkpoint (a rank's shard covers whole blocks, so
the shards of the blocks are the blocks of the shard). Dummy weights of a
model that keeps FP8 Linear weights are drawn FP8, with scales that give them the magnitude of
the other dummy weights, so a model holds half the bytes it would in bf16 for those layers.

Under tensor parallelism (the model built for a group of size N > 1) each rank reads only its
shard of every split tensor, and under expert parallelism only its experts (the `ShardSpec`s
of the parameter, through safetensors `get_slice`), so no rank reads or holds the whole
checkpoint; shapes are checked against the full tensor. Dummy weights are drawn in full, one
tensor at a time, and cut to the rank's part, so they equal the parts of the N = 1 dummy
weights of the same seed (at the cost of one full tensor of transient memory per rank while
drawing).
"""

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from mlaserve.config import ModelConfig
from mlaserve.distributed import get_tp_group
from mlaserve.distributed.expert_parallel import get_ep_group
from mlaserve.kernels.fp8_blocks import (
    BLOCK_SIZE,
    FP8_DTYPE,
    FP8_MAX,
    quantize_block_fp8,
    scale_shape,
)
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.fp8 import SCALE_SUFFIX, Fp8WeightSlice, keep_fp8_weights
from mlaserve.model.fp8_linear import (
    keep_linears_fp8,
    product_shapes,
    unquantized_input_shapes,
)
from mlaserve.model.layers import RMSNorm, RotaryEmbedding
from mlaserve.model.mtp import PREFIX as MTP_PREFIX
from mlaserve.model.mtp import SHARED_COPIES as MTP_SHARED_COPIES
from mlaserve.model.parallel_linear import ShardSpec, tensor_parallel_shards

LOAD_FORMATS = ("auto", "safetensors", "dummy")
FP8_PRODUCTS_ENV = "MLASERVE_FP8_PRODUCTS"  # measured (default) | rules
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\."
                     r"(?P<part>gate_proj|up_proj|down_proj)\.weight$")
# stacked experts' parameter -> (the per-expert checkpoint tensors it holds, their suffix)
_EXPERT_STACKS = {"gate_up_proj": (("gate_proj", "up_proj"), "weight"),
                  "down_proj": (("down_proj",), "weight"),
                  "gate_up_scale_inv": (("gate_proj", "up_proj"), "weight" + SCALE_SUFFIX),
                  "down_scale_inv": (("down_proj",), "weight" + SCALE_SUFFIX)}
DUMMY_WEIGHT_RANGE = 0.02  # dummy weights are uniform in [-0.02, 0.02]
DUMMY_DRAW_ELEMENTS = 1 << 26  # a dummy tensor is drawn in slices of this many elements
_FUSED_FP8_MESSAGE = ("FP8 weights in the fused-experts layout ({key}, 3-D) have no published "
                      "format: store the experts one by one (mlp.experts.N.gate_proj.weight ...) "
                      "as DeepSeek does, or dequantize the checkpoint "
                      "(python -m mlaserve.model.fp8_checkpoint dequantize SRC DST)")
_FUSED_QUANTIZE_MESSAGE = ("{key} stores the experts fused (3-D), which --quantization fp8 does "
                           "not quantize as it loads: write a block-FP8 copy first (python -m "
                           "mlaserve.model.fp8_checkpoint quantize SRC DST), or load with "
                           "--quantization auto")


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


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_name(model: DeepseekForCausalLM, name: str) -> str:
    """A parameter's name (or a name under its module) -> the checkpoint tensor's name: the
    same, but for the MTP module's (`MTPModule.checkpoint_name`)."""
    if model.mtp is not None and name.startswith(MTP_PREFIX):
        return model.mtp.checkpoint_name(name.removeprefix(MTP_PREFIX))
    return name


def parameter_name(model: DeepseekForCausalLM, key: str) -> str | None:
    """A checkpoint tensor's name -> the parameter it loads into, or None for the layers the
    model does not hold (index >= num_hidden_layers, but the MTP module's) and the MTP layer's
    copies of the embedding and the LM head."""
    if model.mtp is not None and key.startswith(f"model.layers.{model.mtp.layer_idx}."):
        return model.mtp.parameter_name(key)
    layer = _LAYER.match(key)
    return None if layer and int(layer.group(1)) >= model.config.num_hidden_layers else key


def _expected_tensors(model: DeepseekForCausalLM
                      ) -> tuple[dict[str, tuple[str, int | None, str]], set[str]]:
    """Checkpoint name -> (parameter name, local expert index or None, part) for every tensor
    this rank needs, and the names of the experts other expert-parallel ranks own."""
    expected, elsewhere = {}, set()
    num_experts = model.config.n_routed_experts
    for name, param in model.named_parameters():
        prefix, _, stack = name.rpartition(".")
        if prefix.endswith(".experts") and stack in _EXPERT_STACKS:
            first = model.get_submodule(prefix).first_expert
            parts, suffix = _EXPERT_STACKS[stack]
            for e in range(num_experts):
                local = e - first
                for part in parts:
                    key = checkpoint_name(model, f"{prefix}.{e}.{part}.{suffix}")
                    if 0 <= local < param.shape[0]:
                        expected[key] = (name, local, part)
                    else:
                        elsewhere.add(key)
        else:
            expected[checkpoint_name(model, name)] = (name, None, "")
    return expected, elsewhere


def checkpoint_tensor_shapes(model: DeepseekForCausalLM) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> full shape of every high-precision tensor a published checkpoint of
    this (unsharded, not FP8) model holds: one [I, H] or [H, I] tensor per routed expert and
    projection, the model's own shape for the rest (the tied LM head left out). With the MTP
    module, its layer too, with the copies of the embedding and the LM head [V, H] that
    published checkpoints store (and the loader skips)."""
    params = dict(model.named_parameters())
    shapes = {}
    for key, (name, expert, part) in _expected_tensors(model)[0].items():
        shape = tuple(params[name].shape)
        if expert is not None:  # a stack [E, 2I, H] (gate, up) or [E, H, I] (down)
            shape = (shape[1] // 2, shape[2]) if part in ("gate_proj", "up_proj") else shape[1:]
        shapes[key] = shape
    if model.mtp is not None:
        for name in MTP_SHARED_COPIES:
            shapes[f"model.layers.{model.mtp.layer_idx}.{name}"] = tuple(
                params["model.embed_tokens.weight"].shape)
    return shapes


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
    return source if cuts else source[:]


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


def _scale_target(scale_key: str, expected: dict[str, tuple[str, int | None, str]],
                  params: dict[str, torch.Tensor], shards: dict[str, ShardSpec]
                  ) -> tuple[torch.Tensor, ShardSpec | None]:
    """`_target` of the scales `scale_key` of an FP8 weight the model keeps FP8."""
    name, expert, part = expected[scale_key]
    return _target(params[name], shards.get(name), expert, part)


def load_weights(model: DeepseekForCausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor (this rank's shard of it) into its parameter; one
    ValueError lists all problems."""
    config, tp = model.config, model.tp
    params = dict(model.named_parameters())
    shards = tensor_parallel_shards(model) if tp.size > 1 else {}
    cuts = _cuts(model)
    expected, elsewhere = _expected_tensors(model)
    pending = set(expected)
    missing: list[str] = []  # FP8 scales; the model's own tensors are the `pending` ones
    unexpected: list[str] = []
    wrong_shape: list[str] = []
    block_size = config.weight_block_size or BLOCK_SIZE
    files = checkpoint_files(model_dir)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    locations = {key: handle for handle in handles for key in handle.keys()}
    with tqdm(total=len(locations), desc="Loading weights", unit="tensor", leave=False,
              disable=None) as bar:
        for key, handle in locations.items():
            bar.update(1)
            if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in locations:
                continue  # read with its weight (into its parameter if the model keeps FP8)
            param_name = parameter_name(model, key)
            if param_name is None:
                continue  # multi-token-prediction layers (or their shared copies) not held
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if config.tie_word_embeddings and key == "lm_head.weight":
                continue
            if key in elsewhere:
                continue  # an expert another expert-parallel rank owns
            fused = key.endswith(".mlp.experts.gate_up_proj") or key.endswith(
                ".mlp.experts.down_proj")
            if fused and param_name in params:  # stacked experts: this rank's part of the stack
                targets = [n for n, (p, _, _) in expected.items() if p == param_name]
                target, key_cuts = params[param_name], cuts.get(param_name, [])
            elif key in expected:
                targets = [key, key + SCALE_SUFFIX]  # an FP8 Linear's scales load with it
                name, expert, part = expected[key]
                target, spec = _target(params[name], shards.get(name), expert, part)
                key_cuts = [] if spec is None else [(spec, tp.rank, tp.size)]
            else:
                unexpected.append(key)
                continue
            source = handle.get_slice(key)
            shape = tuple(source.get_shape())
            full_shape = _full_shape(target.shape, key_cuts)
            if shape != full_shape:
                wrong_shape.append(f"{key}: checkpoint {shape}, model {full_shape}")
                pending.difference_update(targets)  # reported once, as wrong shape
                continue
            scale_key = key + SCALE_SUFFIX
            if source.get_dtype().startswith("F8"):
                if fused:
                    raise ValueError(f"{model_dir}: " + _FUSED_FP8_MESSAGE.format(key=key))
                problem = _fp8_problem(key, source.get_dtype(), shape, locations, block_size)
                if problem is not None:
                    (missing if problem[0] == "missing" else wrong_shape).append(problem[1])
                    pending.difference_update(targets)  # reported once, by its scale
                    continue
                scale = locations[scale_key].get_slice(scale_key)
                if target.dtype == FP8_DTYPE:  # kept FP8: the weight and scales as stored
                    scale_target, scale_spec = _scale_target(scale_key, expected, params, shards)
                    scale_cuts = [] if scale_spec is None else [(scale_spec, tp.rank, tp.size)]
                    with torch.no_grad():
                        target.copy_(_cut(source, shape, key_cuts))
                        scale_target.copy_(_cut(scale, tuple(scale.get_shape()), scale_cuts))
                    pending.difference_update(targets)
                    continue
                source = Fp8WeightSlice(source, scale, shape, target.device, block_size)
            elif target.dtype == FP8_DTYPE:  # kept FP8, stored high precision: quantized here
                if fused:
                    raise ValueError(f"{model_dir}: " + _FUSED_QUANTIZE_MESSAGE.format(key=key))
                if scale_key in locations:
                    unexpected.append(f"{scale_key} (its weight is not FP8)")
                tensor = _cut(source, shape, key_cuts) if key_cuts else handle.get_tensor(key)
                weight_fp8, weight_scales = quantize_block_fp8(
                    tensor.to(target.device, torch.float32), block_size)
                # the scales of this rank's shard, as quantized: no cut to take
                scale_target, _ = _scale_target(scale_key, expected, params, shards)
                with torch.no_grad():
                    target.copy_(weight_fp8)
                    scale_target.copy_(weight_scales)
                pending.difference_update(targets)
                continue
            elif scale_key in locations:
                unexpected.append(f"{scale_key} (its weight is not FP8)")
            if key_cuts:  # reads this rank's rows / columns only
                tensor = _cut(source, shape, key_cuts)
            elif isinstance(source, Fp8WeightSlice):
                tensor = source.full()
            else:
                tensor = handle.get_tensor(key)
            with torch.no_grad():
                target.copy_(tensor)
            pending.difference_update(targets)
    problems = []
    missing += sorted(pending)
    if missing:
        problems.append(f"missing {len(missing)}: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_listing(unexpected)}")
    if wrong_shape:
        problems.append(f"wrong shape {len(wrong_shape)}: {_listing(wrong_shape)}")
    if problems:
        raise ValueError(f"checkpoint {model_dir} does not match its config.json: "
                         + "; ".join(problems))


def _fp8_problem(key: str, dtype: str, shape: tuple[int, ...], locations: dict[str, Any],
                 block_size: tuple[int, int]) -> tuple[str, str] | None:
    """Why FP8 weight `key` [out, in] cannot be dequantized, as ("missing" or "wrong shape",
    message), or None: it is not e4m3 or 2-D, or its `weight_scale_inv` is missing or not of
    shape [ceil(out / b0), ceil(in / b1)]."""
    scale_key = key + SCALE_SUFFIX
    if dtype != "F8_E4M3" or len(shape) != 2:
        return "wrong shape", (f"{key}: checkpoint {dtype} {shape}, model float8_e4m3fn "
                               "[out, in] (block-FP8 weights are 2-D e4m3)")
    if scale_key not in locations:
        return "missing", f"{scale_key} (the scales of FP8 weight {key})"
    found = tuple(locations[scale_key].get_slice(scale_key).get_shape())
    want = scale_shape(shape, block_size)
    if found != want:
        return "wrong shape", (f"{scale_key}: checkpoint {found}, model {want} (FP8 weight "
                               f"{shape} in {block_size[0]}x{block_size[1]} blocks)")
    return None


def _listing(names, limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def init_dummy_weights(model: DeepseekForCausalLM, seed: int) -> None:
    """Random weights from the config alone: small uniform values, norms at one. A split
    parameter gets its shard of the full tensor drawn with the same generator state, so every
    tensor- or expert-parallel size yields shards of the same model. FP8 weights are uniform
    FP8 values in [-448, 448] with scales 0.02 / 448 (the magnitude of the other weights)."""
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
            if name.endswith(SCALE_SUFFIX):
                param.fill_(DUMMY_WEIGHT_RANGE / FP8_MAX)
                continue
            bound = FP8_MAX if param.dtype == FP8_DTYPE else DUMMY_WEIGHT_RANGE
            _draw_uniform(param, cuts.get(name, []), bound, generator)


def _draw_uniform(param: torch.Tensor, cuts: list[Cut], bound: float,
                  generator: torch.Generator) -> None:
    """Fill param with its cut of a full tensor uniform in [-bound, bound]. The full tensor is
    drawn in slices of `DUMMY_DRAW_ELEMENTS` of its flat elements, each in float32 for an FP8
    param (uniform_ has no FP8 kernel), into param itself where it is the full tensor: the
    temporaries stay small however large the tensor (a V3 layer's stacked expert weights are
    7.5 G elements, 30 GB in float32). The slices depend on the full tensor's size only, so
    every parallel size draws the same full tensor."""
    full_shape = _full_shape(param.shape, cuts)
    full = param.new_empty(full_shape) if cuts else param
    draw_dtype = torch.float32 if param.dtype == FP8_DTYPE else param.dtype
    flat = full.view(-1)  # [numel], contiguous
    for start in range(0, flat.numel(), DUMMY_DRAW_ELEMENTS):
        piece = flat[start:start + DUMMY_DRAW_ELEMENTS]
        drawn = torch.empty(piece.shape, dtype=draw_dtype, device=piece.device)
        piece.copy_(drawn.uniform_(-bound, bound, generator=generator))
    if cuts:
        param.copy_(_cut(full, full_shape, cuts))


def build_model(config: ModelConfig, model_dir: Path | None, *, device: torch.device,
                dtype: torch.dtype, load_format: str, max_positions: int,
                quantization: str = "auto", seed: int = 0,
                with_mtp: bool = False) -> DeepseekForCausalLM:
    """Allocate the model directly on `device` in `dtype`, then load or randomise its weights.

    with_mtp: also build and fill the checkpoint's multi-token-prediction module (`model.mtp`;
    a ValueError where the config has num_nextn_predict_layers = 0).

    Its Linear weights stay block-FP8 where `keep_fp8_weights` says so for the config's
    `quant_method`, `quantization` (`mlaserve.option_values.QUANTIZATION_MODES`) and the device.
    Under tensor parallelism (`mlaserve.distributed.init_tensor_parallel` called before) the
    model is this rank's shard; every rank of the group calls this with the same arguments.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format '{load_format}'; use one of {LOAD_FORMATS}")
    tp_size = get_tp_group().size
    config.check_tensor_parallel_size(tp_size)
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, max_positions, with_mtp=with_mtp)
    model = model.to(dtype)  # before the FP8 layers, which the cast would cast too
    if keep_fp8_weights(config.quant_method, quantization, device):
        keep_linears_fp8(model, tp_size)
    model = model.to_empty(device=device)
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
    if device.type == "cuda":
        choose_fp8_products(model, device)
    return model.eval()


def choose_fp8_products(model: DeepseekForCausalLM, device: torch.device) -> None:
    """Install the measured block-FP8 product of each of the model's FP8 Linear shapes on this
    GPU (`kernels.fp8_product_table`; measured on the first load of these shapes on this GPU
    model, read from the cache after). FP8_PRODUCTS_ENV=rules keeps `product_path`'s rules
    (no measurement: a fresh machine's first load spends a minute or more on it)."""
    shapes = product_shapes(model)
    choice = os.environ.get(FP8_PRODUCTS_ENV, "measured")
    if choice not in ("measured", "rules"):
        raise ValueError(f"{FP8_PRODUCTS_ENV}={choice!r}: use measured or rules")
    if not shapes or choice == "rules":
        return
    from mlaserve.kernels import fp8_product_table
    from mlaserve.kernels.fp8_product_choice import load_or_measure

    fp8_product_table.install(load_or_measure(shapes, device,
                                              unquantized_input_shapes(model) & shapes))
