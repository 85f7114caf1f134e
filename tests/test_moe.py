"""Expert computation: the grouped-GEMM path and the loop against a dense float32 reference."""

import torch
import torch.nn.functional as F

from mlaserve.kernels.moe import fused_experts, fused_experts_loop


def dense_reference(x, w13, w2, weights, ids):
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, k].double() * (w2[e].double() @ (F.silu(gate) * up))
    return out


def test_grouped_and_loop_match_the_reference():
    torch.manual_seed(0)
    tokens, dim, inter, experts, top_k = 37, 32, 16, 8, 3
    x = torch.randn(tokens, dim)
    w13, w2 = torch.randn(experts, 2 * inter, dim) / 6, torch.randn(experts, dim, inter) / 4
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    ids[:, 0] = 2  # expert 2 is popular, and expert 7 gets no token at all
    ids[ids == 7] = 1
    ids = torch.where(ids[:, 1:2] == ids[:, 0:1], (ids + 3) % 7, ids)
    weights = torch.rand(tokens, top_k)
    ref = dense_reference(x, w13, w2, weights, ids)
    for impl in (fused_experts, fused_experts_loop):
        out = impl(x, w13, w2, weights, ids)
        assert (out.double() - ref).abs().max() < 1e-4


def test_shared_experts_folded_into_the_stacks_equal_the_shared_mlp():
    """MoE.process_weights_after_loading appends the shared MLP's column blocks as experts
    E .. E + S - 1; the layer's output must equal routed experts + shared MLP computed apart."""
    from mlaserve.config import ModelConfig
    from mlaserve.model.moe_layer import MoE
    from tests.conftest import BASE

    config = ModelConfig.from_dict({
        **BASE, "model_type": "deepseek_v3", "n_shared_experts": 2, "topk_method": "noaux_tc",
        "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5})
    torch.manual_seed(0)
    moe = MoE(config)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape) / 4)
    x = torch.randn(9, config.hidden_size)
    moe.gate.process_weights_after_loading()
    moe.shared_experts.process_weights_after_loading()  # the unfolded MLP: gate_up fused
    with torch.no_grad():
        weights, ids = moe.gate(x)
        expected = dense_reference(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights,
                                   ids) + moe.shared_experts(x).double()
        moe.process_weights_after_loading()
        assert moe.shared_experts is None and moe.num_shared_experts == 2
        assert moe.gate_up_stack.shape[0] == config.n_routed_experts + 2
        out = moe(x)
    assert (out.double() - expected).abs().max() < 1e-4


def test_unrouted_pairs_add_nothing():
    """An id of -1 (expert parallelism's pairs for other ranks' experts, and padding rows) adds
    nothing: the grouped path and the loop equal the reference without those pairs, whole rows
    of -1 give zeros."""
    torch.manual_seed(1)
    tokens, dim, inter, experts, top_k = 23, 32, 16, 8, 3
    x = torch.randn(tokens, dim)
    w13, w2 = torch.randn(experts, 2 * inter, dim) / 6, torch.randn(experts, dim, inter) / 4
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    unrouted = torch.rand(tokens, top_k) < 0.4
    unrouted[3] = True  # a padding row
    ids = ids.masked_fill(unrouted, -1)
    ref = dense_reference(x, w13, w2, weights.masked_fill(unrouted, 0), ids.clamp(min=0))
    assert ref[3].abs().max() == 0 and ref.abs().max() > 0.1
    for impl in ("grouped", "loop"):
        out = fused_experts(x, w13, w2, weights, ids, impl=impl, has_unrouted=True)
        assert (out.double() - ref).abs().max() < 1e-4, impl
