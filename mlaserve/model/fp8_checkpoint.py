"""Rewrite HF safetensors checkpoints between high precision and DeepSeek's block-FP8 layout.

    python -m mlaserve.model.fp8_checkpoint quantize SRC DST     # bf16/fp32 -> block FP8
    python -m mlaserve.model.fp8_checkpoint dequantize SRC DST   # block FP8 -> bf16 (--dtype)

`quantize_checkpoint` writes the exact published layout (`mlaserve.model.fp8`): every 2-D
Linear weight but the embeddings, router and LM head becomes float8_e4m3fn with its float32
`weight_scale_inv`, and config.json gets DeepSeek's `quantization_config`.
`dequantize_checkpoint` is the inverse (DeepSeek's fp8_cast_bf16.py): the model the FP8
checkpoint defines, in a high-precision dtype (a scale may sit in another file than its weight).
Both work one file at a time and keep the file names (and the sharded index), so shard
boundaries survive.
"""

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mlaserve.config import FP8_QUANTIZATION_CONFIG, parse_dtype
from mlaserve.kernels.fp8_blocks import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from mlaserve.model.fp8 import SCALE_SUFFIX, stays_high_precision
from mlaserve.model.loader import checkpoint_files

Tensors = dict[str, torch.Tensor]


def quantize_tensors(tensors: Tensors) -> Tensors:
    """One file's tensors in the published FP8 layout: `X.weight` -> FP8 `X.weight` [out, in]
    plus float32 `X.weight_scale_inv` [ceil(out/128), ceil(in/128)], except the tensors
    `stays_high_precision` keeps as they are."""
    out: Tensors = {}
    for name, tensor in tensors.items():
        if stays_high_precision(name, tensor) or tensor.dtype == FP8_DTYPE:
            out[name] = tensor
            continue
        out[name], out[name + SCALE_SUFFIX] = quantize_block_fp8(tensor)
    return out


def dequantize_tensors(tensors: Tensors, dtype: torch.dtype,
                       scale_of: Callable[[str], torch.Tensor]) -> Tensors:
    """One file's tensors with every FP8 weight dequantized to `dtype` and the scales dropped;
    `scale_of(name)` reads a scale stored in another file."""
    out: Tensors = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if tensor.dtype == FP8_DTYPE:
            scale_name = name + SCALE_SUFFIX
            scale_inv = tensors[scale_name] if scale_name in tensors else scale_of(scale_name)
            out[name] = dequantize_block_fp8(tensor, scale_inv).to(dtype)
        else:
            out[name] = tensor
    return out


def _rewrite(src: Path, dst: Path, transform: Callable[[Tensors], Tensors],
             edit_config: Callable[[dict], None]) -> None:
    """Copy the model directory src to dst with every safetensors file's tensors transformed
    (one file in memory at a time), the index's weight map rebuilt and config.json edited."""
    src, dst = Path(src), Path(dst)
    files = checkpoint_files(src)
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():  # tokenizer, generation config, code: as they are
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, dst / path.name)
    weight_map: dict[str, str] = {}
    total_size = 0
    for path in files:
        tensors = transform(load_file(path))
        save_file(tensors, dst / path.name, metadata={"format": "pt"})
        weight_map |= {name: path.name for name in tensors}
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
    if (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(
            weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((src / "config.json").read_text())
    edit_config(config)
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def quantize_checkpoint(src_dir: str | Path, dst_dir: str | Path) -> None:
    """Write the bf16/fp32 HF checkpoint `src_dir` to `dst_dir` in DeepSeek's published
    block-FP8 layout, with `quantization_config` in its config.json."""
    _rewrite(Path(src_dir), Path(dst_dir), quantize_tensors,
             lambda config: config.update(quantization_config=dict(FP8_QUANTIZATION_CONFIG)))


def dequantize_checkpoint(src_dir: str | Path, dst_dir: str | Path,
                          dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the block-FP8 checkpoint `src_dir` to `dst_dir` with every FP8 weight
    dequantized to `dtype` and no `quantization_config`."""
    def edit(config: dict) -> None:
        config.pop("quantization_config", None)
        for key in ("torch_dtype", "dtype"):  # transformers >= 5 writes `dtype`
            if key in config or key == "torch_dtype":
                config[key] = str(dtype).removeprefix("torch.")

    files = {name: path for path in checkpoint_files(Path(src_dir))
             for name in safe_open(str(path), framework="pt").keys()}

    def scale_of(name: str) -> torch.Tensor:
        if name not in files:
            raise ValueError(f"{src_dir}: FP8 weight {name.removesuffix(SCALE_SUFFIX)} has no "
                             f"{name}")
        with safe_open(str(files[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    _rewrite(Path(src_dir), Path(dst_dir), lambda t: dequantize_tensors(t, dtype, scale_of),
             edit)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("direction", choices=("quantize", "dequantize"))
    parser.add_argument("src", type=Path, help="HF model directory to read")
    parser.add_argument("dst", type=Path, help="directory to write")
    parser.add_argument("--dtype", default="bfloat16", help="dequantize: the weights' dtype")
    args = parser.parse_args(argv)
    if args.direction == "quantize":
        quantize_checkpoint(args.src, args.dst)
    else:
        dequantize_checkpoint(args.src, args.dst, parse_dtype(args.dtype))


if __name__ == "__main__":
    main()
