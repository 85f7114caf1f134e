"""A random checkpoint of a config has exactly the tensors the loader expects (one per routed
expert and projection, as published), and `mlaserve bench load` loads it and reports the
model's bytes: half as many Linear bytes with --quantization fp8."""

import json
import re
import shutil

import pytest
from safetensors import safe_open

from mlaserve.cli import main
from mlaserve.model.random_checkpoint import write_random_checkpoint

DEMO_CONFIG = "mlaserve/demo_model/config.json"


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("random")
    shutil.copy(DEMO_CONFIG, path / "config.json")
    written = write_random_checkpoint(path, seed=3)
    return path, written


def test_it_holds_the_published_layout(random_dir):
    path, written = random_dir
    config = json.loads((path / "config.json").read_text())
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    experts = {k for k in index if ".mlp.experts." in k}
    # the MoE layers, the multi-token-prediction layer (index num_hidden_layers) among them
    moe_layers = (config["num_hidden_layers"] + config["num_nextn_predict_layers"]
                  - config["first_k_dense_replace"])
    assert len(experts) == moe_layers * config["n_routed_experts"] * 3
    key = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert index[key] == "model-layers-00001.safetensors"
    with safe_open(str(path / index[key]), "pt") as f:
        down = f.get_tensor(key)
    assert tuple(down.shape) == (config["hidden_size"], config["moe_intermediate_size"])
    assert 0 < down.abs().max() <= 0.02 and str(down.dtype) == "torch.bfloat16"
    total = json.loads((path / "model.safetensors.index.json").read_text())["metadata"]
    assert written == total["total_size"] == sum(f.stat().st_size for f in path.glob(
        "*.safetensors")) - sum(_header_bytes(f) for f in path.glob("*.safetensors"))


def _header_bytes(file) -> int:
    """A safetensors file's 8-byte length and JSON header."""
    with open(file, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_bench_load_loads_it_with_fp8_linears_at_a_quarter_of_float32(random_dir, capsys):
    path, _ = random_dir
    model_gb = {}
    for quantization in ("none", "fp8"):
        assert main(["bench", "load", str(path), "--device", "cpu", "--dtype", "float32",
                     "--quantization", quantization]) == 0
        out = capsys.readouterr().out
        assert f"(quantization {quantization}) in " in out
        assert re.search(r"host: peak anonymous memory [\d.]+ GB", out)
        model_gb[quantization] = float(re.search(r"model on cpu: ([\d.]+) GB", out).group(1))
    assert 0 < model_gb["fp8"] < 0.6 * model_gb["none"]
