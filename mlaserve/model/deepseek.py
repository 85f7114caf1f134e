"""DeepSeek-V2/V3 (MLA + MoE) over a flat token axis and a paged latent KV cache.

Parameter names equal the Hugging Face checkpoint names (`model.layers.N.self_attn.q_a_proj.weight`
...), except the routed experts, which live stacked in `mlp.experts.gate_up_proj [E, 2I, D]` and
`mlp.experts.down_proj [E, D, I]` (the loader maps per-expert tensors into them), and the
optional multi-token-prediction module's, under `mtp.` (`mlaserve.model.mtp`; the checkpoint's
layer num_hidden_layers).

Tensor parallelism (`mlaserve.distributed`, size N; the model is built after the group is set):
each rank holds H / N attention heads (q or q_b, kv_b and o projections split by head; q_a,
kv_a, their norms and the latent cache replicated, so attention backends see H / N heads over
the full latent), I / N columns of the dense MLP and of every routed and shared expert, and
V / N rows of the embedding and LM head. The router is replicated. Per layer, o_proj and the
MLP (or MoE) each all-reduce their [T, D] output once; the embedding all-reduces once and
`compute_logits` gathers the vocabulary (for the engine, to the rank that samples). Every
rank runs the same forward on the same inputs. At N = 1 no collective runs and the model
computes as a single process always did.

The small ops between the GEMMs (norms with the residual adds, rope, the latent cache write) are
the building blocks of `mlaserve.model.layers`: fused Triton kernels on CUDA, torch on CPU.
"""

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.prefill import expanded_prefill
from mlaserve.config import ModelConfig
from mlaserve.distributed import get_tp_group
from mlaserve.distributed.expert_parallel import get_ep_group
from mlaserve.kernels.fp8_blocks import (
    BLOCK_SIZE,
    FP8_DTYPE,
    QuantizedActivations,
    QuantizedWithRows,
    scale_shape,
)
from mlaserve.kernels.moe import ExpertChoice, fused_experts, runs_w8a8, select_experts
from mlaserve.model.expert_parallel import expert_parallel_moe
from mlaserve.model.fp8_linear import keep_linear_fp8
from mlaserve.model.layers import (
    FusedLinear,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    write_latent_cache,
)
from mlaserve.model.mtp import MTPModule
from mlaserve.model.parallel_linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    divide,
)


class MLAAttention(nn.Module):
    """Multi-head Latent Attention.

    q = W_q x (or W_qb norm(W_qa x)), split per head into q_nope [P] and q_pe [R];
    [c_kv | k_pe] = W_kva x, c_kv normalised, rope on q_pe and k_pe; the cache stores [c_kv | k_pe].
    Prefill expands c_kv with kv_b_proj = [W_UK; W_UV] into per-head k_nope, v. Decode absorbs
    W_UK into the query (q_latent = q_nope W_UK, [H, L]) and W_UV into the output
    (o = o_latent W_UV^T), so attention runs over the latent rows directly. The absorbed query
    [q_latent | rope(q_pe)] is assembled in place: the bmm and the rope write its two column
    ranges, and the output bmm writes straight into the per-head output.

    H below is this rank's heads, num_attention_heads / tensor-parallel size: the per-head
    projections hold only those heads' rows (o_proj their columns, all-reduced), while
    [c_kv | k_pe] is computed in full on every rank, and so is the latent cache.
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = divide(config.num_attention_heads, get_tp_group().size,
                                "num_attention_heads")
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        self.rotary = rotary
        bias = config.attention_bias
        all_heads = config.num_attention_heads  # the parallel layers take full sizes
        q_out = all_heads * config.qk_head_dim
        self.q_lora_rank = config.q_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(config.hidden_size, q_out)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, q_out)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, config.kv_cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            config.kv_lora_rank, all_heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = RowParallelLinear(all_heads * self.v_head_dim, config.hidden_size,
                                        bias=bias)

    def process_weights_after_loading(self) -> None:
        """Stack the two projections of the layer input (q or q_a, and kv_a) into one GEMM
        (under tensor parallelism [this rank's q rows | all kv_a rows]); split kv_b_proj into
        the absorbed decode matrices W_UK [H, P, L] and W_UV^T [H, L, V] of this rank's
        heads. kv_b_proj is in the model dtype even where the other projections are block-FP8
        (`mlaserve.model.fp8_linear`): the absorbed products read it per head."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        self.q_kv_a_split = [first.out_features, self.kv_a_proj_with_mqa.out_features]
        self.q_kv_a = FusedLinear(first, self.kv_a_proj_with_mqa)
        w = self.kv_b_proj.weight.detach()
        w = w.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                   self.kv_lora_rank)  # [H * (P + V), L] -> [H, P + V, L]
        self.w_uk = w[:, : self.qk_nope_head_dim].contiguous()  # [H, P, L]
        self.w_uv_t = w[:, self.qk_nope_head_dim :].transpose(1, 2).contiguous()  # [H, L, V]

    def quantizes_input(self, hidden: torch.Tensor) -> bool:
        """Whether the norm before this layer should quantize its output for the first GEMM."""
        return self.q_kv_a.quantizes_input(hidden)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor | QuantizedActivations, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """hidden [T, D] -> [T, D]; writes this step's latents into kv_cache [N, bs, L + R].

        rope: the step's rotary angles (cos, sin) [T, R / 2] from `RotaryEmbedding.angles`.
        hidden: quantized where `quantizes_input` says so.
        """
        num_tokens = hidden.shape[0]
        # [T, H * (P + R)] (or [T, q_lora_rank]), [T, L + R]
        q, kv = self.q_kv_a(hidden).split(self.q_kv_a_split, dim=-1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q, self.q_b_proj.quantizes_input(q)))
        q = q.view(num_tokens, self.num_heads, -1)  # [T, H, P + R]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_flat = kv_cache.view(-1, kv_cache.shape[-1])  # [num_blocks * block_size, L + R]
        latent = write_latent_cache(
            kv, self.kv_a_layernorm, self.rotary, rope, kv_flat,
            meta.slot_mapping, keep_rows=bool(meta.prefills))  # [T, L + R] or None

        out = kv.new_empty(num_tokens, self.num_heads, self.v_head_dim)
        cos, sin = rope
        d = meta.num_decode_tokens
        if d:
            rank = self.kv_lora_rank
            q_abs = kv.new_empty(d, self.num_heads, rank + self.qk_rope_head_dim)
            # q_abs = [q_nope W_UK | rope(q_pe)]: the bmm writes q_latent [H, d, L] through a
            # transposed view of the first L columns, the rope the last R columns
            torch.bmm(q_nope[:d].transpose(0, 1), self.w_uk,
                      out=q_abs[..., :rank].transpose(0, 1))  # [d, H, L] viewed [H, d, L]
            self.rotary(q_pe[:d], (cos[:d], sin[:d]), out=q_abs[..., rank:])  # [d, H, R]
            o_latent = meta.decode_backend.run(q_abs, kv_cache)  # [d, H, L]
            torch.bmm(o_latent.transpose(0, 1), self.w_uv_t,
                      out=out[:d].transpose(0, 1))  # o = o_latent W_UV^T: [d, H, V] as [H, d, V]
        if num_tokens > d:  # prefill rows: rope in place, so q[rows] = [q_nope | rope(q_pe)]
            self.rotary(q_pe[d:], (cos[d:], sin[d:]), out=q_pe[d:])
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = expanded_prefill(
                q[rows], latent[rows], kv_flat, chunk,
                self.kv_b_proj.weight, self.num_heads, self.qk_nope_head_dim, self.v_head_dim,
                self.kv_lora_rank, self.softmax_scale)
        return self.o_proj(out.view(num_tokens, -1))  # [T, H * V] -> [T, D]


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


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor, meta: AttentionMetadata,
                expert_capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One pre-norm layer, x + attn(norm(x)) then x + mlp(norm(x)), on a carried residual.

        Args:
            hidden: [T, D] the previous layer's MLP output (the embeddings for the first layer).
            residual: [T, D] the stream that output is to be added to (None for the first layer).
            expert_capacity: a MoE layer's exchange rows under expert parallelism (`MoE`).

        Returns:
            (mlp_out, residual) [T, D]: the stream is residual + mlp_out. Each residual add is
            folded into the norm that follows it (`RMSNorm.add_and_norm`), which may update
            `hidden` and `residual` in place, and which quantizes its output where the GEMM
            after it runs a w8a8 product (`quantizes_input`).
        """
        quantize = self.self_attn.quantizes_input(hidden)
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden, quantize)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual, quantize)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(
            hidden, residual, self.mlp.quantizes_input(hidden),
            keep_rows=isinstance(self.mlp, MoE))
        if isinstance(self.mlp, MoE):
            return self.mlp(hidden, expert_capacity), residual
        return self.mlp(hidden), residual


class DeepseekBody(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, max_positions, config.rope_theta,
                                      config.rope_scaling, config.rope_interleave)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """The whole model; `forward` gives final hidden states, `compute_logits` the vocabulary.

    Built for the current tensor-parallel group (`mlaserve.distributed.get_tp_group()`, kept as
    `tp`): this rank's shard of every split weight.

    With `with_mtp`, also the checkpoint's multi-token-prediction module as `mtp`
    (`mlaserve.model.mtp.MTPModule`, layer index `mtp.layer_idx` = num_hidden_layers, sharing
    the embedding and the LM head; None without): `mtp(input_ids, positions, previous_hidden,
    kv_cache, meta)` gives its final normed hidden states, `compute_logits` their logits, and
    the model needs `num_kv_cache_layers` latent caches, the last one the MTP layer's (the
    loader maps its parameter names to the checkpoint's, `loader.checkpoint_name`).
    """

    def __init__(self, config: ModelConfig, max_positions: int, with_mtp: bool = False) -> None:
        super().__init__()
        self.config = config
        self.tp = get_tp_group()
        self.model = DeepseekBody(config, max_positions)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp: MTPModule | None = None
        if with_mtp:
            if config.num_nextn_predict_layers < 1:
                raise ValueError("with_mtp: this checkpoint has no multi-token-prediction (MTP) "
                                 "layer (its config.json has num_nextn_predict_layers = "
                                 f"{config.num_nextn_predict_layers})")
            layer_idx, rotary = config.num_hidden_layers, self.model.rotary
            self.mtp = MTPModule(config, DecoderLayer(config, layer_idx, rotary), rotary,
                                 self.model.embed_tokens)

    @property
    def num_kv_cache_layers(self) -> int:
        """The latent caches the model needs: one per decoder layer, plus the MTP layer's."""
        return self.config.num_hidden_layers + (self.mtp is not None)

    def process_weights_after_loading(self) -> None:
        """Derive the run-time forms of the loaded weights: every submodule's
        `process_weights_after_loading` (fused projections, absorbed matrices, float32 router)."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    def join_expert_parallel(self, capacity: int) -> None:
        """A step without tokens on this rank: every MoE layer's expert exchanges of `capacity`
        rows per rank, in order (expert parallelism; the other ranks' forwards meet these)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.join_expert_parallel(capacity)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                expert_capacity: int | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden [T, D].

        expert_capacity: under expert parallelism, the rows per rank that every MoE layer
        exchanges (>= T, agreed by the replicas for the step); None: T (a CUDA graph's batch).
        """
        hidden, residual = self.model.embed_tokens(input_ids), None
        rope = self.model.rotary.angles(positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta, expert_capacity)
        return self.model.norm.add_and_norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, dst: int | None = None
                       ) -> torch.Tensor | None:
        """hidden [N, D] -> logits [N, V] float32, the full vocabulary on every rank, or (dst)
        on that tensor-parallel rank alone (None on the others): a collective either way."""
        logits = self.lm_head.compute_logits(hidden, dst)
        return None if logits is None else logits.float()
