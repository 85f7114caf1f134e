"""Tensor parallelism on CPU with gloo: N processes, each building its shard of a tiny checkpoint
written by transformers, run the same steps (prefills, a mixed step with a chunked prefill over
cached context, decodes through the torch backend) and must give the single-process logits and
latent caches; dummy weights under TP must be the shards of the single-process ones.
"""

import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mlaserve.attention.base import MLAShape
from mlaserve.attention.metadata import AttentionMetadata, PrefillChunk
from mlaserve.attention.registry import create_backend
from mlaserve.config import ModelConfig
from mlaserve.distributed import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    get_tp_group,
    init_tensor_parallel,
    parallel_state,
)
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.loader import build_model
from mlaserve.model.parallel_linear import ShardSpec, tensor_parallel_shards
from tests.conftest import BASE, CHECKPOINTS, write_checkpoint

BLOCK_SIZE = 4
PAGES = {"a": [3, 7, 1], "b": [2, 10, 4], "c": [9, 5, 11]}  # request -> its cache pages
NUM_BLOCKS = 12
# per step: decodes (request, position), prefill chunks (request, start, num_tokens)
STEPS = [
    ([], [("a", 0, 6), ("b", 0, 3), ("c", 0, 4)]),
    ([("a", 6), ("b", 3)], [("c", 4, 3)]),  # c's second chunk attends over its cached context
    ([("a", 7), ("b", 4), ("c", 7)], []),
]
SEQ_LEN = 8  # tokens per request the steps read (teacher-forced)


def _slots(request: str, start: int, count: int) -> list[int]:
    pages = PAGES[request]
    return [pages[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for p in range(start, start + count)]


def run_steps(model: DeepseekForCausalLM,
              seed: int = 1) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Run STEPS on `model` (this rank's shard) in float32 with the torch decode backend, on
    token ids drawn from `seed`.

    Returns:
        {"logits": [sum of the steps' tokens, V] float32, "caches": per layer
        [NUM_BLOCKS, BLOCK_SIZE, L + R]}.
    """
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    tokens = {name: torch.randint(0, config.vocab_size, (SEQ_LEN,), generator=gen).tolist()
              for name in PAGES}
    shape = MLAShape(num_heads=config.num_attention_heads // get_tp_group().size,
                     kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim,
                     block_size=BLOCK_SIZE, dtype=torch.float32, device=torch.device("cpu"))
    backend = create_backend("torch", shape, config.softmax_scale)
    caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, config.kv_cache_dim)
              for _ in range(config.num_hidden_layers)]
    logits = []
    with torch.inference_mode():
        for decodes, prefills in STEPS:
            ids, positions, slots, chunks = [], [], [], []
            for name, position in decodes:
                ids.append(tokens[name][position])
                positions.append(position)
                slots += _slots(name, position, 1)
            for name, start, count in prefills:
                context = torch.tensor(_slots(name, 0, start)) if start else None
                chunks.append(PrefillChunk(token_start=len(ids), num_tokens=count,
                                           context_len=start, context_slots=context))
                ids += tokens[name][start : start + count]
                positions += range(start, start + count)
                slots += _slots(name, start, count)
            if decodes:
                backend.plan(torch.tensor([PAGES[name] for name, _ in decodes], dtype=torch.int32),
                             torch.tensor([p + 1 for _, p in decodes], dtype=torch.int32))
            meta = AttentionMetadata(slot_mapping=torch.tensor(slots),
                                     num_decode_tokens=len(decodes), decode_backend=backend,
                                     prefills=chunks)
            hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
            logits.append(model.compute_logits(hidden))  # [T, V]
    return {"logits": torch.cat(logits), "caches": caches}


def _build(config: ModelConfig, model_dir: Path | None) -> DeepseekForCausalLM:
    return build_model(config, model_dir, device=torch.device("cpu"), dtype=torch.float32,
                       load_format="safetensors" if model_dir else "dummy", max_positions=64,
                       seed=3)


def _rank_main(rank: int, world_size: int, tp_sizes: tuple[int, ...], store: str,
               model_dir: str, out_dir: str, dummy: bool) -> None:
    """One process: for each tensor-parallel size in turn (groups of consecutive ranks), build
    this rank's shard, run the steps and save what it computed as tp{size}-rank{rank}.pt."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        config = ModelConfig.from_pretrained(model_dir)
        for size in tp_sizes:
            assert init_tensor_parallel(size).rank == rank % size
            result = run_steps(_build(config, Path(model_dir)))
            if dummy:
                model = _build(config, None)
                result["dummy"] = {name: p.clone() for name, p in model.named_parameters()}
            torch.save(result, Path(out_dir) / f"tp{size}-rank{rank}.pt")
            destroy_tensor_parallel()
    finally:
        destroy_tensor_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def v3_two_shared_tied(tmp_path_factory) -> Path:
    """V3 with 2 shared experts and tied embeddings: the folded shared experts split by rank."""
    arch, overrides, _ = CHECKPOINTS["v3-noaux-lora-yarn-sharded"]
    path = tmp_path_factory.mktemp("v3-tp")
    write_checkpoint(path, arch, {**overrides, "n_shared_experts": 2,
                                  "tie_word_embeddings": True}, sharded=True)
    return path


@pytest.mark.parametrize("name,world_size,tp_sizes", [
    ("v2-greedy-nolora-untied", 2, (2,)),
    ("v3-two-shared-tied", 2, (2,)),
    ("v3-two-shared-tied", 4, (4, 2)),  # then two groups of 2 in a world of 4
], ids=["v2-tp2", "v3-tp2", "v3-tp4-then-2x2"])
def test_tensor_parallel_equals_one_process(name, world_size, tp_sizes, checkpoint_dir,
                                            v3_two_shared_tied, tmp_path):
    model_dir = v3_two_shared_tied if name == "v3-two-shared-tied" else checkpoint_dir(name)[0]
    config = ModelConfig.from_pretrained(model_dir)
    dummy = world_size == 2
    mp.spawn(_rank_main, args=(world_size, tp_sizes, str(tmp_path / "store"), str(model_dir),
                               str(tmp_path), dummy), nprocs=world_size)
    expected = run_steps(_build(config, model_dir))
    full = _build(config, None) if dummy else None
    for size in tp_sizes:
        ranks = [torch.load(tmp_path / f"tp{size}-rank{r}.pt") for r in range(world_size)]
        for r, rank in enumerate(ranks):
            torch.testing.assert_close(rank["logits"], expected["logits"], atol=1e-4, rtol=1e-4)
            group_first = ranks[r - r % size]  # rank 0 of r's group may sample for all of it
            assert torch.equal(rank["logits"], group_first["logits"])
            for cache, expected_cache in zip(rank["caches"], expected["caches"], strict=True):
                torch.testing.assert_close(cache, expected_cache, atol=1e-5, rtol=1e-5)
        if full is not None:  # dummy weights under TP: the shards of the one-process ones
            shards = tensor_parallel_shards(full)
            for r, rank in enumerate(ranks):
                for param_name, param in full.named_parameters():
                    spec = shards.get(param_name)
                    want = param if spec is None else spec.take(param, param.shape, r, size)
                    assert torch.equal(rank["dummy"][param_name], want), param_name


def test_sharded_loading_reports_full_shapes(checkpoint_dir, tmp_path, monkeypatch):
    """Rank 1 of 2 (loading needs no collective): one error lists a missing expert tensor and a
    wrong-shaped split tensor by the full shapes of checkpoint and model."""
    src, _ = checkpoint_dir("v2-greedy-nolora-untied")
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 62)
    save_file(tensors, path / "model.safetensors")
    monkeypatch.setattr(parallel_state, "_tp_group", TensorParallelGroup(rank=1, size=2))
    with pytest.raises(ValueError) as info:
        _build(ModelConfig.from_pretrained(path), path)
    message = str(info.value)
    assert "missing 1: model.layers.1.mlp.experts.3.up_proj.weight" in message
    assert ("wrong shape 1: model.layers.0.self_attn.o_proj.weight: checkpoint (64, 62), "
            "model (64, 64)") in message


def test_shard_spec_reads_each_piece_from_a_safetensors_slice(tmp_path):
    full = torch.arange(3 * 8 * 5, dtype=torch.float32).view(3, 8, 5)  # [E, 2I, D], I = 4
    save_file({"w": full}, tmp_path / "w.safetensors")
    spec = ShardSpec(1, pieces=2)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        source = handle.get_slice("w")
        rank1 = spec.take(source, source.get_shape(), rank=1, size=2)
    assert torch.equal(rank1, torch.cat((full[:, 2:4], full[:, 6:8]), dim=1))  # gate | up
    assert torch.equal(spec.take(full, full.shape, 1, 2), rank1)
    assert spec.full_shape(rank1.shape, 2) == tuple(full.shape)


def test_sizes_that_do_not_divide_are_named():
    config = ModelConfig.from_dict({**BASE, "model_type": "deepseek_v3"})
    config.check_tensor_parallel_size(4)
    with pytest.raises(ValueError, match=r"does not divide num_attention_heads=4; sizes that "
                                         r"divide them all: 1, 2, 4$"):
        config.check_tensor_parallel_size(8)
    with pytest.raises(ValueError, match="vocab_size=256, moe_intermediate_size=32"):
        config.check_tensor_parallel_size(3)
