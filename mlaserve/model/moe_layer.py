"""DeepSeek's MoE block (the paper's DeepSeekMoE): the router, the routed experts stacked
[E, 2I, D] / [E, D, I] (the loader maps the checkpoint's per-expert tensors into them), the
shared experts folded into the stacks after loading, and one fused MoE over them
(`kernels.moe.fused_experts`); under expert parallelism the tokens' exchange
(`model/expert_parallel.py`). `model/deepseek.py` builds one in every MoE layer.
"""

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config import ModelConfig
from mlaserve.distributed import get_tp_group
from mlaserve.distributed.expert_parallel import get_ep_group
from mlaserve.kernels.fp8_blocks import BLOCK_SIZE, FP8_DTYPE, QuantizedWithRows, scale_shape
from mlaserve.kernels.moe import ExpertChoice, fused_experts, runs_w8a8, select_experts
from mlaserve.model.expert_parallel import expert_parallel_moe
from mlaserve.model.fp8_linear import keep_linear_fp8
from mlaserve.model.layers import GatedMLP
from mlaserve.model.parallel_linear import ShardSpec, divide


class Router(nn.Module):
    """The MoE gate: router logits in float32 and DeepSeek's expert choice."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.choice = ExpertChoice(
            config.num_experts_per_tok, config.scoring_func, config.n_group, config.topk_group,
            config.norm_topk_prob, config.routed_scaling_factor,
            use_grouped_topk=config.topk_method != "greedy")
        num_experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size))
        if config.scoring_func == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None

    def process_weights_after_loading(self) -> None:
        """Keep float32 copies of the router weight and bias (the model's dtype may be lower)."""
        self.weight_fp32 = self.weight.detach().float()  # [E, D]
        bias = self.e_score_correction_bias
        self.bias_fp32 = None if bias is None else bias.detach().float()  # [E]

    def forward(self, x: torch.Tensor, num_shared_experts: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> topk_weights [T, K + S] float32, topk_ids [T, K + S] int64 (the routed
        choice, then the S shared experts folded in after the routed ones)."""
        logits = F.linear(x.float(), self.weight_fp32)  # [T, E]
        return select_experts(logits, self.choice, self.bias_fp32, num_shared_experts)


class RoutedExperts(nn.Module):
    """Stacked SwiGLU experts: gate_up_proj [E, 2I, D] (gate rows then up rows), down_proj
    [E, D, I], with I = moe_intermediate_size / tensor-parallel size: every rank holds all E
    experts, each with this rank's I columns (gate and up rows, down columns). Under expert
    parallelism (size N) a rank holds E / N of the experts instead, global ids `first_expert`
    onward (`ep_shards` says how they are cut from the full stacks), each with its I columns."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        ep = get_ep_group()
        e, d = config.n_routed_experts, config.hidden_size
        if ep.size > 1:
            if e % ep.size:
                raise ValueError(f"n_routed_experts={e} is not divisible by the expert-parallel "
                                 f"size {ep.size} (--data-parallel-size with "
                                 "--enable-expert-parallel)")
            e //= ep.size
        self.first_expert = ep.rank * e
        i = divide(config.moe_intermediate_size, get_tp_group().size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.register_parameter("gate_up_scale_inv", None)  # block-FP8 stacks only
        self.register_parameter("down_scale_inv", None)
        self.tp_shards = {"gate_up_proj": ShardSpec(1, pieces=2), "down_proj": ShardSpec(2)}
        self.ep_shards = {"gate_up_proj": ShardSpec(0), "down_proj": ShardSpec(0)}

    def keep_fp8(self) -> bool:
        """Hold the stacks as the checkpoint's block-FP8 experts: float8_e4m3fn gate_up_proj
        and down_proj with float32 gate_up_scale_inv [E, 2I / 128, ceil(D / 128)] and
        down_scale_inv [E, ceil(D / 128), I / 128], cut like the stacks. Only where I is a
        multiple of 128 (the FP8 MoE kernels start the up rows at a scale block, and a
        tensor-parallel rank's columns must cover whole blocks); returns whether it did."""
        num_experts, two_inter, hidden = self.gate_up_proj.shape
        if (two_inter // 2) % BLOCK_SIZE[0]:
            return False
        for name, (rows, cols) in (("gate_up", (two_inter, hidden)),
                                   ("down", (hidden, two_inter // 2))):
            weight = getattr(self, f"{name}_proj")
            setattr(self, f"{name}_proj", nn.Parameter(
                torch.empty_like(weight, dtype=FP8_DTYPE), requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(torch.empty(
                num_experts, *scale_shape((rows, cols)), device=weight.device),
                requires_grad=False))
            self.tp_shards[f"{name}_scale_inv"] = self.tp_shards[f"{name}_proj"]
            self.ep_shards[f"{name}_scale_inv"] = self.ep_shards[f"{name}_proj"]
        return True


class MoE(nn.Module):
    """Routed experts plus always-on shared experts, run as one fused MoE.

    The checkpoint stores the S = n_shared_experts shared experts as one SwiGLU MLP of S * I
    columns. After loading they are cut into S experts of I columns each and appended to the
    routed stacks as experts E .. E + S - 1, which the router gives every token with weight 1.0:
    the shared MLP is the sum of its column blocks' SwiGLUs, so one fused MoE computes routed
    and shared experts together, and the sum over the K + S experts is the layer's output.

    Under tensor parallelism (size N) I is this rank's moe_intermediate_size / N columns of
    every expert, and the shared MLP's local S * I columns (a consecutive 1/N of its S * I * N)
    are cut into S blocks of I alike: any partition of the columns sums to the same MLP. The
    fused MoE's output is this rank's partial sum, all-reduced once.

    Under expert parallelism (`mlaserve.distributed.expert_parallel`) the stacks hold this
    rank's E / N routed experts and the S shared experts; every rank receives every token and
    runs its experts over them, the shared ones over its own tokens (`expert_parallel_moe`).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.ep = get_ep_group()
        self.gate = Router(config)
        self.experts = RoutedExperts(config)
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = GatedMLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                reduce_results=False)
        self.num_shared_experts = 0  # folded into the stacks after loading

    def quantizes_input(self, x: torch.Tensor) -> bool:
        """Whether the norm before should quantize x as well as store it (the router reads the
        rows, the w8a8 experts the quantized rows: `QuantizedWithRows`): block-FP8 experts
        that `fused_experts` runs w8a8, on this rank's own tokens (under expert parallelism
        the rows are gathered first, and quantized after)."""
        return not self.ep.communicates and runs_w8a8(x, self.gate_up_stack)

    def keep_experts_fp8(self, prefix: str, tp_size: int) -> None:
        """Keep the routed and shared experts block-FP8 where `RoutedExperts.keep_fp8` can
        (I a multiple of 128); otherwise both stay in the model dtype, dequantized at load."""
        if self.experts.keep_fp8() and self.shared_experts is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                keep_linear_fp8(getattr(self.shared_experts, name),
                                f"{prefix}.shared_experts.{name}", tp_size)

    def process_weights_after_loading(self) -> None:
        """Stack [routed | shared] experts: gate_up [E + S, 2I, D], down [E + S, D, I], and
        for block-FP8 experts their scales alike ([E + S, 2I / 128, ceil(D / 128)],
        [E + S, ceil(D / 128), I / 128]). The routed parameters become views of the stacks;
        the shared MLP module is dropped."""
        experts, shared = self.experts, self.shared_experts
        if shared is None:
            if not self.num_shared_experts:  # no shared experts: the stacks are the parameters
                self.gate_up_stack = experts.gate_up_proj.detach()
                self.down_stack = experts.down_proj.detach()
                self.gate_up_scale_stack = _detached(experts.gate_up_scale_inv)
                self.down_scale_stack = _detached(experts.down_scale_inv)
            return
        num_routed, num_shared = experts.gate_up_proj.shape[0], self.gate.config.n_shared_experts
        self.gate_up_stack, self.down_stack = _fold_shared_experts(
            experts.gate_up_proj, experts.down_proj, shared.gate_proj.weight,
            shared.up_proj.weight, shared.down_proj.weight, num_shared)
        experts.gate_up_proj = nn.Parameter(self.gate_up_stack[:num_routed], requires_grad=False)
        experts.down_proj = nn.Parameter(self.down_stack[:num_routed], requires_grad=False)
        self.gate_up_scale_stack = self.down_scale_stack = None
        if experts.gate_up_scale_inv is not None:  # the scale blocks fold the same way
            self.gate_up_scale_stack, self.down_scale_stack = _fold_shared_experts(
                experts.gate_up_scale_inv, experts.down_scale_inv,
                shared.gate_proj.weight_scale_inv, shared.up_proj.weight_scale_inv,
                shared.down_proj.weight_scale_inv, num_shared)
            experts.gate_up_scale_inv = nn.Parameter(self.gate_up_scale_stack[:num_routed],
                                                     requires_grad=False)
            experts.down_scale_inv = nn.Parameter(self.down_scale_stack[:num_routed],
                                                  requires_grad=False)
        self.shared_experts = None
        self.num_shared_experts = num_shared

    def forward(self, x: torch.Tensor | QuantizedWithRows,
                expert_capacity: int | None = None) -> torch.Tensor:
        """x [T, D] (with its quantized rows where `quantizes_input` asked) -> [T, D].
        expert_capacity: under expert parallelism, the rows per rank of the step's exchanges
        (`expert_parallel_moe`; None: T)."""
        x_quantized = None
        if isinstance(x, QuantizedWithRows):
            x, x_quantized = x.rows, x.quantized
        if self.ep.communicates:
            return self._forward_expert_parallel(x, expert_capacity)
        topk_weights, topk_ids = self.gate(x, self.num_shared_experts)  # [T, K + S]
        out = fused_experts(x, self.gate_up_stack, self.down_stack, topk_weights, topk_ids,
                            shared_experts=self.num_shared_experts, x_quantized=x_quantized,
                            **self._scales())
        return self.tp.all_reduce(out)  # this rank's I columns of each expert: a partial sum

    def _scales(self) -> dict[str, torch.Tensor | None]:
        """`fused_experts`' scale arguments; None for stacks in the model dtype."""
        return {"gate_up_scale_inv": self.gate_up_scale_stack,
                "down_scale_inv": self.down_scale_stack}

    def _forward_expert_parallel(self, x: torch.Tensor, capacity: int | None) -> torch.Tensor:
        """Routed experts across the expert-parallel ranks, shared experts on this rank's
        tokens, in one exchange; under tensor parallelism both are this rank's column shards,
        all-reduced once."""
        topk_weights, topk_ids = self.gate(x)  # [T, K] global routed ids
        out = expert_parallel_moe(x, topk_weights, topk_ids, self.gate_up_stack,
                                  self.down_stack, self.ep, capacity, self.num_shared_experts,
                                  **self._scales())
        return self.tp.all_reduce(out)

    def join_expert_parallel(self, capacity: int) -> None:
        """This rank has no tokens; serve the other ranks' tokens for this rank's experts in
        exchanges of `capacity` rows per rank."""
        hidden = self.gate_up_stack.shape[2]
        top_k = self.gate.choice.top_k
        x = self.gate.weight.new_empty(0, hidden)  # [0, D] in the model dtype
        ids = torch.empty(0, top_k, dtype=torch.int64, device=x.device)  # [0, K]
        weights = torch.empty(0, top_k, dtype=torch.float32, device=x.device)  # [0, K]
        expert_parallel_moe(x, weights, ids, self.gate_up_stack, self.down_stack, self.ep,
                            capacity, self.num_shared_experts, **self._scales())


def _detached(param: torch.Tensor | None) -> torch.Tensor | None:
    return None if param is None else param.detach()


def _fold_shared_experts(gate_up: torch.Tensor, down: torch.Tensor, shared_gate: torch.Tensor,
                         shared_up: torch.Tensor, shared_down: torch.Tensor,
                         num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Append S shared experts to the routed stacks: gate_up [E, 2I, D] and down [E, D, I]
    with the shared MLP's gate, up [S * I, D] and down [D, S * I] give [E + S, 2I, D] and
    [E + S, D, I]. The same for FP8 scale blocks, with I / 128 and ceil(D / 128) blocks in place
    of I and D."""
    inter, rows = shared_gate.shape[0] // num_shared, shared_down.shape[0]
    gate = shared_gate.detach().view(num_shared, inter, -1)  # [S * I, D] -> [S, I, D]
    up = shared_up.detach().view(num_shared, inter, -1)  # [S * I, D] -> [S, I, D]
    shared = shared_down.detach().view(rows, num_shared, inter).transpose(
        0, 1)  # [D, S * I] -> [S, D, I]
    return (torch.cat((gate_up.detach(), torch.cat((gate, up), dim=1))),  # [E + S, 2I, D]
            torch.cat((down.detach(), shared)))  # [E + S, D, I]
