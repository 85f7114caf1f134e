"""Shared fixtures: tiny random DeepSeek checkpoints written by transformers' own classes."""

import json
import os
from pathlib import Path

import torch

# Triton kernels run on CPU through the interpreter; it must be chosen before triton is imported
# (torch imports it lazily, so set it before any test module touches a kernel).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# fixtures of the bench serve tests (a scripted server on a virtual clock, a tiny tokenizer)
pytest_plugins = ["tests.bench_serve_util"]

DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "mlaserve" / "demo_model"
# the demo model's vocabulary (its tokenizer's size rounded up to a multiple of 64)
DEMO_VOCAB = json.loads((DEMO_TOKENIZER / "config.json").read_text())["vocab_size"]

BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=512,
    initializer_range=0.1, bos_token_id=0, eos_token_id=1,
)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

# name -> (architecture, config overrides, sharded)
CHECKPOINTS = {
    "v2-greedy-nolora-untied": ("v2", dict(q_lora_rank=None, topk_method="greedy"), False),
    "v2-grouped-lora-yarn-tied-sharded": ("v2", dict(
        q_lora_rank=32, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        rope_scaling=YARN, tie_word_embeddings=True), True),
    "v3-noaux-lora-yarn-sharded": ("v3", dict(
        q_lora_rank=32, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}),
        True),
    "v3-dense-nolora-tied": ("v3", dict(q_lora_rank=None, first_k_dense_replace=3,
                                        tie_word_embeddings=True), False),
    # random weights over the whole demo tokenizer: where a test needs a model that knows
    # nothing (structured outputs hold by the grammar's mask alone)
    "v3-random-demo-vocab": ("v3", dict(vocab_size=DEMO_VOCAB, q_lora_rank=32, n_group=4,
                                        topk_group=2), False),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` (pyproject.toml) skip cleanly where there is no CUDA GPU."""
    if torch.cuda.is_available():
        return
    needs_gpu = pytest.mark.skipif(True, reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(needs_gpu)


def write_checkpoint(path: Path, arch: str, overrides: dict, sharded: bool, seed: int = 0):
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    config_cls, model_cls = ((DeepseekV2Config, DeepseekV2ForCausalLM) if arch == "v2"
                             else (DeepseekV3Config, DeepseekV3ForCausalLM))
    config = config_cls(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.05)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "1GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((DEMO_TOKENIZER / name).read_bytes())
    return model


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """checkpoint_dir(name) -> (path, HF model) for a named tiny checkpoint, built once."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(name: str):
        if name not in cache:
            arch, overrides, sharded = CHECKPOINTS[name]
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, write_checkpoint(path, arch, overrides, sharded))
        return cache[name]

    return make


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="session")
def demo_server():
    """One real server on the demo model with default options (CPU), shared by the test
    modules that need nothing else (each asserts on differences, never on totals)."""
    from tests.server_util import RunningServer

    with RunningServer() as running:
        yield running


@pytest.fixture(scope="session")
def demo_client(demo_server):
    """An openai SDK client for `demo_server`."""
    import openai

    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused")


@pytest.fixture
def record_drafts(monkeypatch):
    """record_drafts() -> a list that gets every step's drafts (`StepResult.drafts`, by request
    id) that runners collect from then on, until the next call or the test's end."""
    from mlaserve.engine import runner as runner_module

    collect = runner_module.collect_results

    def start() -> list[dict]:
        drafted: list[dict] = []

        def recording(*args, **kwargs):
            result = collect(*args, **kwargs)
            drafted.append(result.drafts)
            return result

        monkeypatch.setattr(runner_module, "collect_results", recording)
        return drafted

    return start
