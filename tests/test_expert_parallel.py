"""Data-parallel attention with expert-parallel MoE on CPU with gloo: two ranks, each with its
own requests and half of every layer's routed experts, must compute what one process computes
for those requests; a rank with no tokens still joins every exchange; dummy weights under expert
parallelism are the rows of the single-process ones.
"""

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mlaserve.config import ModelConfig
from mlaserve.distributed.expert_parallel import (
    ExpertParallelGroup,
    destroy_expert_parallel,
    init_expert_parallel,
)
from mlaserve.model import expert_parallel as expert_parallel_moe
from mlaserve.model.deepseek import MoE
from tests.conftest import BASE
from tests.test_tensor_parallel import _build, run_steps, v3_two_shared_tied  # noqa: F401

WORLD_SIZE = 2
CAPACITY, CHUNK = 7, 3


def _first_moe(model) -> MoE:
    return next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))


def _moe_input(rank: int, hidden: int) -> torch.Tensor:
    """Rank 0 has 5 tokens, rank 1 none (an idle replica); they exchange `CAPACITY` rows each,
    in chunks of `CHUNK` (three chunks, the last one padding only)."""
    return torch.randn(5 if rank == 0 else 0, hidden,
                       generator=torch.Generator().manual_seed(7))


def _rank_main(rank: int, store: str, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    try:
        assert init_expert_parallel().rank == rank
        config = ModelConfig.from_pretrained(model_dir)
        model = _build(config, Path(model_dir))
        result = run_steps(model, seed=1 + rank)  # each replica its own requests
        expert_parallel_moe.EXCHANGE_CHUNK = CHUNK
        with torch.inference_mode():
            result["moe"] = _first_moe(model)(_moe_input(rank, config.hidden_size),
                                              expert_capacity=CAPACITY)
        experts = _first_moe(_build(config, None)).experts
        result["dummy"] = (experts.gate_up_proj.clone(), experts.down_proj.clone())
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_expert_parallel()
        dist.destroy_process_group()


def test_data_parallel_with_expert_parallel_equals_one_process(
        v3_two_shared_tied, tmp_path):  # noqa: F811
    config = ModelConfig.from_pretrained(v3_two_shared_tied)
    mp.spawn(_rank_main, args=(str(tmp_path / "store"), str(v3_two_shared_tied),
                               str(tmp_path)), nprocs=WORLD_SIZE)
    model = _build(config, v3_two_shared_tied)
    full = _first_moe(_build(config, None)).experts
    local = config.n_routed_experts // WORLD_SIZE
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        expected = run_steps(model, seed=1 + rank)
        torch.testing.assert_close(result["logits"], expected["logits"], atol=1e-4, rtol=1e-4)
        for cache, expected_cache in zip(result["caches"], expected["caches"], strict=True):
            torch.testing.assert_close(cache, expected_cache, atol=1e-5, rtol=1e-5)
        with torch.inference_mode():
            expected_moe = _first_moe(model)(_moe_input(rank, config.hidden_size))
        torch.testing.assert_close(result["moe"], expected_moe, atol=1e-5, rtol=1e-5)
        rows = slice(rank * local, (rank + 1) * local)
        gate_up, down = result["dummy"]
        assert torch.equal(gate_up, full.gate_up_proj[rows])
        assert torch.equal(down, full.down_proj[rows])


def _world_of_one_main(rank: int, store: str, model_dir: str, out_dir: str) -> None:
    """A gloo world of one rank: the same MoE layer on its local path and on the
    expert-parallel path (group of one, every collective run), padded and chunked."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        config = ModelConfig.from_pretrained(model_dir)
        moe = _first_moe(_build(config, Path(model_dir)))
        x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            local = moe(x)
            moe.ep = ExpertParallelGroup(rank=0, size=1, group=dist.group.WORLD)
            expert_parallel_moe.EXCHANGE_CHUNK = 4  # 11 rows: chunks of 4, 4 and 3
            exchanged = moe(x, expert_capacity=11)
        torch.save({"local": local, "exchanged": exchanged}, Path(out_dir) / "one.pt")
    finally:
        dist.destroy_process_group()


def test_expert_parallel_path_in_a_world_of_one_equals_the_local_moe(
        v3_two_shared_tied, tmp_path):  # noqa: F811
    mp.spawn(_world_of_one_main, args=(str(tmp_path / "store"), str(v3_two_shared_tied),
                                       str(tmp_path)), nprocs=1)
    result = torch.load(tmp_path / "one.pt")
    assert result["local"].abs().max() > 0.01
    torch.testing.assert_close(result["exchanged"], result["local"], atol=1e-5, rtol=1e-5)


def test_expert_counts_that_do_not_divide_are_named(monkeypatch):
    from mlaserve.distributed import expert_parallel

    monkeypatch.setattr(expert_parallel, "_ep_group",
                        expert_parallel.ExpertParallelGroup(rank=0, size=3))
    config = ModelConfig.from_dict({**BASE, "model_type": "deepseek_v3"})
    with pytest.raises(ValueError, match="n_routed_experts=8 is not divisible by the "
                                         "expert-parallel size 3"):
        MoE(config)
