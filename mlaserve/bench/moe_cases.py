"""The cases `mlaserve bench moe` times: model shapes, weight copies rotated past the L2, the
float32 reference, the check against it and the CUDA-graph timer. Usage: `mlaserve bench moe
--help`."""

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlaserve.kernels.fp8_blocks import quantize_block_fp8
from mlaserve.kernels.fused_moe import fused_experts_triton
from mlaserve.kernels.fused_moe_config import FusedMoEConfig, moe_config
from mlaserve.kernels.moe import (
    REFERENCE_TOLERANCES,
    W8A8_REFERENCE_TOLERANCES,
    fused_experts,
    fused_experts_loop,
    fused_experts_w8a8_reference,
    reference_errors,
)
from mlaserve.kernels.testing import l2_bytes

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class MoEShape:
    """Routed-expert dimensions of one model."""

    hidden: int  # D
    inter: int  # I (moe_intermediate_size)
    num_experts: int  # E
    top_k: int  # K

    def expert_bytes(self, element_size: int) -> int:
        """Bytes of one expert's gate, up and down weights."""
        return 3 * self.inter * self.hidden * element_size


MODELS = {
    "v2-lite": MoEShape(hidden=2048, inter=1408, num_experts=64, top_k=6),
    "v3": MoEShape(hidden=7168, inter=2048, num_experts=256, top_k=8),
}


@dataclass
class Case:
    """Inputs of one (model, T): copies of the weights, and the float32 reference output."""

    shape: MoEShape
    x: torch.Tensor  # [T, D] bf16
    gate_up: list[torch.Tensor]  # copies of [E, 2I, D] bf16 or float8_e4m3fn
    down: list[torch.Tensor]  # copies of [E, D, I] bf16 or float8_e4m3fn
    topk_weights: torch.Tensor  # [T, K] float32
    topk_ids: torch.Tensor  # [T, K] int64
    ref: torch.Tensor  # [T, D] float32
    scales: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8: the stacks' block scales

    def weights(self, copy: int) -> dict[str, torch.Tensor | None]:
        """`fused_experts`' weight arguments for weight copy `copy` (the copies share scales)."""
        gate_up_scale_inv, down_scale_inv = self.scales or (None, None)
        return dict(gate_up_proj=self.gate_up[copy], down_proj=self.down[copy],
                    gate_up_scale_inv=gate_up_scale_inv, down_scale_inv=down_scale_inv)

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def num_pairs(self) -> int:
        return self.topk_ids.numel()

    def weight_bytes(self) -> int:
        """Weights one call reads: every expert that got at least one token."""
        return self.topk_ids.unique().numel() * self.shape.expert_bytes(
            self.gate_up[0].element_size())

    def flops(self) -> int:
        return 2 * self.num_pairs * 3 * self.shape.inter * self.shape.hidden


def make_weights(shape: MoEShape, device: torch.device, fp8: bool
                 ) -> tuple[list, list, tuple[torch.Tensor, torch.Tensor] | None]:
    """Identical copies of (gate_up_proj [E, 2I, D], down_proj [E, D, I]), as many as keep a
    call's smallest weight set (K experts) out of L2 between two reads of one copy (at least 2,
    if they fit in 60% of free memory); with fp8 the stacks are block-FP8 and their scales
    (gate_up [E, 2I / 128, ceil(D / 128)], down [E, ceil(D / 128), I / 128]) come third."""
    generator = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(shape.num_experts, 2 * shape.inter, shape.hidden, generator=generator,
                          device=device, dtype=DTYPE).mul_(shape.hidden ** -0.5)
    down = torch.randn(shape.num_experts, shape.hidden, shape.inter, generator=generator,
                       device=device, dtype=DTYPE).mul_(shape.inter ** -0.5)
    scales = None
    if fp8:
        (gate_up, gate_up_scales), (down, down_scales) = (quantize_block_fp8(gate_up),
                                                          quantize_block_fp8(down))
        scales = (gate_up_scales, down_scales)
    element_size = gate_up.element_size()
    copy_bytes = shape.num_experts * shape.expert_bytes(element_size)
    smallest_call = shape.top_k * shape.expert_bytes(element_size)
    wanted = max(2, 1 + math.ceil(2 * l2_bytes(torch.device("cuda")) / smallest_call))
    free, _ = torch.cuda.mem_get_info()
    copies = max(1, min(wanted, 1 + int(0.6 * free) // copy_bytes))
    if copies < wanted:
        print(f"  only {copies} weight copies fit (wanted {wanted})")
    return ([gate_up] + [gate_up.clone() for _ in range(copies - 1)],
            [down] + [down.clone() for _ in range(copies - 1)], scales)


def make_case(shape: MoEShape, num_tokens: int, gate_up: list, down: list,
              scales: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device) -> Case:
    generator = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, shape.hidden, generator=generator, device=device, dtype=DTYPE)
    scores = torch.rand(num_tokens, shape.num_experts, generator=generator, device=device)
    topk_ids = scores.topk(shape.top_k, dim=-1).indices  # [T, K] distinct, uniform
    topk_weights = torch.rand(num_tokens, shape.top_k, generator=generator, device=device)
    topk_weights = topk_weights.softmax(dim=-1)
    if scales is None:
        ref = fused_experts_loop(x, gate_up[0], down[0], topk_weights, topk_ids,
                                 compute_dtype=torch.float32)
    else:
        ref = fused_experts_w8a8_reference(x, gate_up[0], down[0], topk_weights, topk_ids,
                                           *scales)
    return Case(shape, x, gate_up, down, topk_weights, topk_ids, ref, scales)


def check(case: Case, out: torch.Tensor) -> tuple[bool, float, float]:
    """(passed, relative error, 1 - least per-row cosine) against the float32 reference."""
    rel_err, cos_gap = reference_errors(out, case.ref)
    rel_bound, cos_bound = (REFERENCE_TOLERANCES[DTYPE] if case.scales is None
                            else W8A8_REFERENCE_TOLERANCES)
    return rel_err < rel_bound and cos_gap < cos_bound, rel_err, cos_gap


def graph_seconds(call: Callable[[int], object], num_copies: int, calls: int,
                  replays: int) -> float:
    """Median seconds per call: `calls` calls of call(copy), rotating over the copies, captured
    in one CUDA graph; each replay between two CUDA events."""
    for copy in range(num_copies):  # compile and warm up outside the capture
        call(copy)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % num_copies)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    torch.cuda.empty_cache()
    return statistics.median(times) / calls


def run_impl(case: Case, impl: str, copy: int = 0) -> torch.Tensor:
    """One call of `impl` on weight copy `copy`: "triton", "grouped", or "triton-swap" (the
    Triton path with its default tiles computed transposed)."""
    if impl != "triton-swap":
        return fused_experts(case.x, topk_weights=case.topk_weights, topk_ids=case.topk_ids,
                             impl=impl, **case.weights(copy))
    shape = case.shape
    config = moe_config(case.num_pairs, shape.num_experts, shape.hidden, shape.inter,
                        case.gate_up[0].dtype, case.x.device)
    config = dataclasses.replace(
        config, gate_up=dataclasses.replace(config.gate_up, swap_ab=True),
        down=dataclasses.replace(config.down, swap_ab=True))
    return fused_experts_triton(case.x, topk_weights=case.topk_weights,
                                topk_ids=case.topk_ids, config=config, **case.weights(copy))


def time_impl(case: Case, impl: str, calls: int, replays: int) -> float:
    def call(copy: int) -> torch.Tensor:
        return run_impl(case, impl, copy)

    return graph_seconds(call, len(case.gate_up), calls, replays)


def time_config(case: Case, config: FusedMoEConfig, calls: int, replays: int) -> float:
    def call(copy: int) -> torch.Tensor:
        return fused_experts_triton(case.x, topk_weights=case.topk_weights,
                                    topk_ids=case.topk_ids, config=config, **case.weights(copy))

    return graph_seconds(call, len(case.gate_up), calls, replays)
