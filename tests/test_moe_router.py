"""The fused expert-selection kernel (`fused_router`) against the torch routing it replaces.

Without a CUDA GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
conftest before triton is imported); with one it runs natively. Each DeepSeek routing (V2-Lite
greedy softmax, V2 group-limited softmax, V3 noaux_tc sigmoid with a correction bias) and the
tiny test configurations, expert counts that are not powers of two among them, must give the
torch path's ids in the same (descending choice) order and its weights; deliberate ties must
give distinct valid ids with the right weights.
"""

import os
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels import fused_router  # noqa: E402
from mlaserve.kernels.fused import force_fused_kernels  # noqa: E402
from mlaserve.kernels.fused_router import select_experts_triton  # noqa: E402
from mlaserve.kernels.moe import (  # noqa: E402
    ExpertChoice,
    select_experts,
    select_experts_torch,
)

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or TRITON_INTERPRET=1")

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The interpreter's exp is NumPy's; on a GPU tl.exp is ex2.approx on x * log2(e), a few ulps
# further from torch's expf.
RTOL = 4e-6 if ON_GPU else 1e-6


class Routing(NamedTuple):
    num_experts: int
    top_k: int
    scoring_func: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    use_grouped_topk: bool
    has_bias: bool

    def args(self, bias: torch.Tensor | None) -> tuple[ExpertChoice, torch.Tensor | None]:
        """The positional arguments of `select_experts` after the logits."""
        return ExpertChoice(self.top_k, self.scoring_func, self.n_group, self.topk_group,
                            self.norm_topk_prob, self.routed_scaling_factor,
                            self.use_grouped_topk), bias


ROUTINGS = {
    "v2-lite": Routing(64, 6, "softmax", 1, 1, False, 1.0, False, False),
    "v2": Routing(160, 6, "softmax", 8, 3, False, 16.0, True, False),
    "v3": Routing(256, 8, "sigmoid", 8, 4, True, 2.5, True, True),
    # the tiny checkpoints of conftest
    "tiny-v2-greedy": Routing(8, 2, "softmax", 1, 1, False, 1.0, False, False),
    "tiny-v2-grouped": Routing(8, 2, "softmax", 4, 2, False, 1.0, True, False),
    "tiny-v3": Routing(8, 2, "sigmoid", 4, 2, True, 2.5, True, True),
    # expert counts and group counts that are not powers of two (padded lanes and groups)
    "greedy-12-norm": Routing(12, 3, "softmax", 1, 1, True, 1.0, False, False),
    "v2-grouped-12-of-3": Routing(12, 4, "softmax", 3, 2, False, 2.0, True, False),
    "v3-6-of-2": Routing(6, 3, "sigmoid", 2, 1, True, 2.5, True, True),
    "v3-top1": Routing(16, 1, "sigmoid", 2, 1, True, 1.0, True, True),
}


def _inputs(routing: Routing, num_tokens: int,
            seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(num_tokens, routing.num_experts, generator=gen)
    bias = 0.1 * torch.randn(routing.num_experts, generator=gen) if routing.has_bias else None
    return logits.to(DEVICE), None if bias is None else bias.to(DEVICE)


@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_kernel_matches_the_torch_routing(name: str, num_tokens: int) -> None:
    routing = ROUTINGS[name]
    logits, bias = _inputs(routing, num_tokens, seed=num_tokens)
    weights, ids = select_experts_triton(logits, *routing.args(bias))
    expected_weights, expected_ids = select_experts_torch(logits, *routing.args(bias))
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (num_tokens, routing.top_k)
    assert torch.equal(ids, expected_ids)  # same experts, same (descending choice) order
    torch.testing.assert_close(weights, expected_weights, rtol=RTOL, atol=0)


def test_strided_logits_and_no_tokens() -> None:
    routing = ROUTINGS["v2"]
    logits, _ = _inputs(routing, 3, seed=7)
    wide = torch.full((3, 200), float("nan"), device=DEVICE)
    wide[:, 20:180] = logits
    view = wide[:, 20:180]  # row stride 200: only the view's columns may be read
    weights, ids = select_experts_triton(view, *routing.args(None))
    expected_weights, expected_ids = select_experts_torch(logits, *routing.args(None))
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=RTOL, atol=0)
    weights, ids = select_experts_triton(logits[:0], *routing.args(None))
    assert weights.shape == ids.shape == (0, routing.top_k)


def _assert_valid(ids: torch.Tensor, num_experts: int) -> None:
    assert ((ids >= 0) & (ids < num_experts)).all()
    for row in ids.tolist():
        assert len(set(row)) == len(row), row


@pytest.mark.parametrize("name", ["v2-lite", "v2", "v3", "v3-6-of-2"])
def test_ties_give_distinct_experts_lowest_index_first(name: str) -> None:
    """All-equal logits (and a zero bias): every expert and group ties, so the kernel takes the
    lowest indices, and the weights are the equal scores (renormalised where the routing does)."""
    routing = ROUTINGS[name]
    num_tokens = 2
    logits = torch.zeros(num_tokens, routing.num_experts, device=DEVICE)
    bias = torch.zeros(routing.num_experts, device=DEVICE) if routing.has_bias else None
    weights, ids = select_experts_triton(logits, *routing.args(bias))
    _assert_valid(ids, routing.num_experts)
    assert ids.tolist() == [list(range(routing.top_k))] * num_tokens
    score = 1 / routing.num_experts if routing.scoring_func == "softmax" else 0.5
    if routing.norm_topk_prob:
        score = 1 / routing.top_k
    expected = torch.full_like(weights, score * routing.routed_scaling_factor)
    torch.testing.assert_close(weights, expected, rtol=RTOL, atol=0)


def test_choices_past_the_kept_groups_stay_valid() -> None:
    """V3 with more experts than the kept groups hold: the rest are chosen among the -inf
    (masked) experts, never among the padded lanes, and are distinct; the weights are their
    unbiased scores, as in torch."""
    routing = Routing(6, 5, "sigmoid", 2, 1, False, 1.0, True, True)
    logits, bias = _inputs(routing, 4, seed=3)
    weights, ids = select_experts_triton(logits, *routing.args(bias))
    _assert_valid(ids, routing.num_experts)
    expected_weights, expected_ids = select_experts_torch(logits, *routing.args(bias))
    # the kept group's three experts come first, in torch's order
    assert torch.equal(ids[:, :3], expected_ids[:, :3])
    scores = logits.sigmoid()
    torch.testing.assert_close(weights, scores.gather(1, ids), rtol=RTOL, atol=0)
    torch.testing.assert_close(weights[:, :3], expected_weights[:, :3], rtol=RTOL, atol=0)


@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_nan_logits_still_give_valid_experts(name: str) -> None:
    """A NaN logit must not turn into an out-of-range expert id (the expert kernels would read
    out of bounds): NaN choices rank first, as in torch.topk."""
    routing = ROUTINGS[name]
    logits, bias = _inputs(routing, 2, seed=11)
    logits[0, 5] = float("nan")
    weights, ids = select_experts_triton(logits, *routing.args(bias))
    _assert_valid(ids, routing.num_experts)
    if routing.scoring_func == "sigmoid":  # one NaN score: that expert first, the rest as usual
        expected_weights, expected_ids = select_experts_torch(logits, *routing.args(bias))
        assert ids[0, 0] == 5 and torch.equal(ids, expected_ids)


def test_select_experts_dispatches_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    routing = ROUTINGS["tiny-v3"]
    logits, bias = _inputs(routing, 3, seed=5)
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return select_experts_triton(*args, **kwargs)

    monkeypatch.setattr(fused_router, "select_experts_triton", spy)
    with force_fused_kernels():
        weights, ids = select_experts(logits, *routing.args(bias))
    assert calls == [logits.shape]
    expected_weights, expected_ids = select_experts_torch(logits, *routing.args(bias))
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=RTOL, atol=0)
    if not ON_GPU:  # CPU tensors outside force_fused_kernels take the torch path
        select_experts(logits, *routing.args(bias))
        assert len(calls) == 1


@pytest.mark.parametrize("name,num_shared", [("v2-lite", 2), ("v3", 1), ("tiny-v2-greedy", 3)])
def test_shared_experts_follow_the_routed_choice(name: str, num_shared: int) -> None:
    routing = ROUTINGS[name]
    logits, bias = _inputs(routing, 5, seed=3)
    routed_weights, routed_ids = select_experts_torch(logits, *routing.args(bias))
    shared_ids = torch.arange(routing.num_experts, routing.num_experts + num_shared)
    for select in (select_experts_triton, select_experts_torch):
        weights, ids = select(logits, *routing.args(bias), num_shared)
        assert ids.shape == weights.shape == (5, routing.top_k + num_shared)
        assert torch.equal(ids[:, : routing.top_k], routed_ids)
        assert torch.equal(ids[:, routing.top_k :].cpu(), shared_ids.expand(5, -1))
        torch.testing.assert_close(weights[:, : routing.top_k], routed_weights, rtol=RTOL, atol=0)
        assert torch.equal(weights[:, routing.top_k :].cpu(), torch.ones(5, num_shared))
