"""A random high-precision HF checkpoint of a DeepSeek config.json, for load-time and memory
measurements of a model too large to download (`mlaserve bench load`).

    python -m mlaserve.model.random_checkpoint MODEL_DIR [--seed 0] [--dtype bfloat16]

MODEL_DIR holds the config.json; the weights are written beside it in the layout the published
checkpoints use (one tensor per routed expert and projection, `model.layers.N.` prefixes),
one safetensors file per decoder layer plus one for the rest, with the sharded index; a config
with num_nextn_predict_layers > 0 gets the multi-token-prediction layer num_hidden_layers too,
with its copies of the embedding and the LM head, as DeepSeek-V3 is published. Values
are those of dummy weights (uniform in +-0.02, norms at one), drawn one tensor at a time, so
writing takes one layer's memory, not the model's.
"""

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from mlaserve.config import ModelConfig, parse_dtype
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.loader import DUMMY_WEIGHT_RANGE, checkpoint_tensor_shapes

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def write_random_checkpoint(model_dir: str | Path, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16) -> int:
    """Write random weights for MODEL_DIR/config.json; returns the bytes written."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, config.max_position_embeddings,
                                    with_mtp=config.num_nextn_predict_layers > 0)
    by_file: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    for key, shape in checkpoint_tensor_shapes(model).items():
        layer = _LAYER.match(key)
        by_file[f"layers-{int(layer.group(1)):05d}" if layer else "rest"].append((key, shape))
    generator = torch.Generator().manual_seed(seed)
    weight_map, written = {}, 0
    for stem, tensors in sorted(by_file.items()):
        name = f"model-{stem}.safetensors"
        values = {}
        for key, shape in tensors:
            if key.endswith("norm.weight"):
                values[key] = torch.ones(shape, dtype=dtype)
            elif key.endswith("e_score_correction_bias"):
                values[key] = torch.zeros(shape, dtype=torch.float32)
            else:
                values[key] = torch.empty(shape).uniform_(
                    -DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator).to(dtype)
            weight_map[key] = name
            written += values[key].numel() * values[key].element_size()
        save_file(values, str(model_dir / name), metadata={"format": "pt"})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": written}, "weight_map": weight_map}, indent=1) + "\n")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlaserve.model.random_checkpoint",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="a directory with a DeepSeek config.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    args = parser.parse_args(argv)
    written = write_random_checkpoint(args.model_dir, args.seed, parse_dtype(args.dtype))
    print(f"wrote {written / 1e9:.2f} GB of random weights into {args.model_dir}")


if __name__ == "__main__":
    main()
