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
from torch import nn

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.prefill import expanded_prefill
from mlaserve.config import ModelConfig
from mlaserve.distributed import get_tp_group
from mlaserve.kernels.fp8_blocks import (
    QuantizedActivations,
)
from mlaserve.model.layers import (
    FusedLinear,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    write_latent_cache,
)
from mlaserve.model.moe_layer import MoE
from mlaserve.model.mtp import MTPModule
from mlaserve.model.parallel_linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
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
