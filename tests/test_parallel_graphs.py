"""The parallel code path inside CUDA graphs, on one GPU: an NCCL world of one rank whose
tensor- and expert-parallel groups are that world, so every collective of the parallel path
(the tensor-parallel all-reduces, the expert dispatch and combine, the logits' gather) runs,
captured in the decode graphs, and must change nothing."""

import socket

import pytest
import torch
import torch.distributed as dist

from mlaserve import LLM, SamplingParams
from mlaserve.config import ModelConfig
from mlaserve.distributed import expert_parallel, parallel_state
from mlaserve.distributed.expert_parallel import ExpertParallelGroup
from mlaserve.distributed.parallel_state import TensorParallelGroup
from mlaserve.kernels.moe import REFERENCE_TOLERANCES, fused_experts_loop, reference_errors
from mlaserve.model.loader import build_model
from mlaserve.model.moe_layer import MoE
from tests.conftest import BASE

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_world_of_one():
    """An initialised NCCL world of one rank (its default group), destroyed afterwards."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _use_parallel_path(monkeypatch, group: dist.ProcessGroup) -> None:
    """Models built from now on take the tensor- and expert-parallel paths over `group`."""
    monkeypatch.setattr(parallel_state, "_tp_group", TensorParallelGroup(0, 1, group))
    monkeypatch.setattr(expert_parallel, "_ep_group", ExpertParallelGroup(0, 1, group))


def test_decode_graphs_on_the_parallel_path_equal_the_plain_path(nccl_world_of_one,
                                                                  monkeypatch):
    """The demo model's shape with dummy weights in float32 (MoE layers included): greedy tokens
    and logprobs of the plain path (eager) and of the parallel path with decode graphs, whose
    captured forwards hold the collectives. The batch shrinks 12 -> 1, so graphs of 16, 8, 4,
    2 and 1 rows replay."""
    prompts = [[(7 * i + 3 * j) % 400 + 1 for j in range(5 + 9 * i)] for i in range(12)]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, logprobs=0, ignore_eos=True)
              for i in range(12)]
    options = dict(device="cuda", dtype="float32", attention_backend="triton", block_size=16,
                   max_num_seqs=16, num_kv_blocks=256, load_format="dummy")
    plain = LLM(enforce_eager=True, **options)
    expected = plain.generate(prompts, params)
    plain.shutdown()
    del plain
    _use_parallel_path(monkeypatch, nccl_world_of_one)
    llm = LLM(**options)
    runner = llm.engine.runner
    moe_layers = [m for m in runner.model.modules() if isinstance(m, MoE)]
    assert moe_layers and all(m.ep.communicates and m.tp.communicates for m in moe_layers)
    assert runner.graphs is not None
    results = llm.generate(prompts, params)
    assert runner.graphs.num_replays > 0
    llm.shutdown()
    for want, got in zip(expected, results, strict=True):
        assert got.token_ids == want.token_ids
        diffs = [abs(a[t] - b[t]) for a, b, t in zip(want.logprobs, got.logprobs, want.token_ids,
                                                       strict=True)]
        assert max(diffs) < 1e-4, diffs  # float32: only summation orders differ


def test_expert_parallel_moe_in_a_graph_equals_the_local_moe(nccl_world_of_one):
    """One bf16 MoE layer (2 shared experts, grouped routing) on the expert-parallel path over
    the world of one, captured in a CUDA graph and replayed on new tokens, against the same
    layer's local path and the float32 loop over the same routing."""
    config = ModelConfig.from_dict({
        **BASE, "model_type": "deepseek_v3", "hidden_size": 256, "moe_intermediate_size": 128,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 2,
        "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5})
    model = build_model(config, None, device=torch.device("cuda"), dtype=torch.bfloat16,
                        load_format="dummy", max_positions=64, seed=4)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    generator = torch.Generator(device="cuda").manual_seed(0)
    static = torch.randn(24, config.hidden_size, generator=generator, device="cuda",
                         dtype=torch.bfloat16)
    moe.ep = ExpertParallelGroup(0, 1, nccl_world_of_one)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(static)  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe(static)
        tokens = torch.randn(static.shape, generator=generator, device="cuda",
                             dtype=torch.bfloat16)
        static.copy_(tokens)
        graph.replay()
        torch.cuda.synchronize()
        moe.ep = ExpertParallelGroup()  # the local path
        local = moe(tokens)
        weights, ids = moe.gate(tokens, moe.num_shared_experts)  # [T, K + S]
        reference = fused_experts_loop(tokens, moe.gate_up_stack, moe.down_stack, weights, ids,
                                       compute_dtype=torch.float32)
    rel_bound, cos_bound = REFERENCE_TOLERANCES[torch.bfloat16]
    for out in (captured, local):
        rel_err, cos_gap = reference_errors(out, reference)
        assert rel_err < rel_bound and cos_gap < cos_bound, (rel_err, cos_gap)
    torch.testing.assert_close(captured, local, atol=2e-2, rtol=2e-2)
