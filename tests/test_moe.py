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
