"""DeepSeek-V3's multi-token-prediction (MTP) module: a draft of the token after next.

The checkpoint stores it as one more layer, index L = num_hidden_layers (config
`num_nextn_predict_layers: 1`). For tokens t [T] at positions p [T], and the main model's final
normed hidden states h [T, D] of the previous position (the states that predicted t):

    e = embed_tokens(t), with e = 0 where p == 0
    x = eh_proj([enorm(e) | hnorm(h)])                  [T, 2D] -> [T, D]
    x = decoder layer L (MLA over its own latent cache, then MLP or MoE; residuals included)
    out = shared_head.norm(x)                           logits = lm_head(out)

as vLLM's DeepSeekMTP and SGLang's NextN compute it (one depth: a config with
num_nextn_predict_layers > 1 gets the first, and its further layers are skipped). The embedding
and the LM head are the main model's: the checkpoint's copies
(`model.layers.L.embed_tokens.weight`, `model.layers.L.shared_head.head.weight`) are not
loaded, and the logits come from `DeepseekForCausalLM.compute_logits`.

Parameter names: the module sits at `mtp` in the model; the decoder layer is `mtp.mtp_block`
(as vLLM names it). `checkpoint_name` and `parameter_name` map between them and the
checkpoint's `model.layers.L.` names: `mtp.enorm.weight` <-> `model.layers.L.enorm.weight`,
`mtp.mtp_block.self_attn.o_proj.weight` <-> `model.layers.L.self_attn.o_proj.weight`.
"""

import torch
from torch import nn

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.config import ModelConfig
from mlaserve.model.layers import RMSNorm, RotaryEmbedding
from mlaserve.model.parallel_linear import ReplicatedLinear, VocabParallelEmbedding

PREFIX = "mtp."  # the module's place in DeepseekForCausalLM
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")  # the rest is the decoder layer's
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the main model's, skipped


class SharedHead(nn.Module):
    """The norm before the (shared) LM head: norm.weight [D]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPModule(nn.Module):
    """One MTP depth: enorm, hnorm [D], eh_proj [D, 2D] (replicated under tensor parallelism,
    block-FP8 where the model keeps FP8 Linears), the decoder layer `mtp_block` (split like any
    layer) and `shared_head.norm` [D].

    Args:
        config: the model config (num_nextn_predict_layers >= 1).
        mtp_block: the decoder layer, `deepseek.DecoderLayer(config, L, rotary)` with
            L = num_hidden_layers (an MoE layer in V3: `config.is_moe_layer(L)`).
        rotary: the main model's rotary embedding (no parameters).
        embed_tokens: the main model's embedding, held unregistered: one copy of the weight,
            under the main model's name.
    """

    def __init__(self, config: ModelConfig, mtp_block: nn.Module, rotary: RotaryEmbedding,
                 embed_tokens: VocabParallelEmbedding) -> None:
        super().__init__()
        self.layer_idx = config.num_hidden_layers
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = ReplicatedLinear(2 * d, d)
        self.mtp_block = mtp_block
        self.shared_head = SharedHead(config)
        self.rotary = rotary
        object.__setattr__(self, "embed_tokens", embed_tokens)  # not a submodule (see above)

    def checkpoint_name(self, name: str) -> str:
        """A name under this module (without `mtp.`) -> its checkpoint tensor's name."""
        return f"model.layers.{self.layer_idx}." + name.removeprefix("mtp_block.")

    def parameter_name(self, key: str) -> str | None:
        """A checkpoint name -> the model's parameter name, or None: not a `model.layers.L.`
        name (or one of the shared copies, which are the main model's)."""
        prefix = f"model.layers.{self.layer_idx}."
        if not key.startswith(prefix) or key.removeprefix(prefix) in SHARED_COPIES:
            return None
        name = key.removeprefix(prefix)
        return PREFIX + (name if name.startswith(_OWN) else "mtp_block." + name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                previous_hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                expert_capacity: int | None = None) -> torch.Tensor:
        """The MTP hidden states of one step.

        Args:
            input_ids, positions: [T] int64, the step's tokens (the token after the one the
                main model saw at the same position: its prediction, or the prompt's next).
            previous_hidden: [T, D] the main model's final normed hidden states that predicted
                input_ids (`DeepseekForCausalLM.forward`'s output, one position back).
            kv_cache: [num_blocks, block_size, L + R] this layer's own latent cache.
            meta: the step's attention metadata (slots and prefill chunks of these tokens).
            expert_capacity: under expert parallelism, the MoE exchange's rows per rank.

        Returns:
            [T, D] shared_head.norm of the layer's output; logits: the main model's
            `compute_logits`.
        """
        embeds = self.embed_tokens(input_ids)  # [T, D]
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)  # no previous token
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous_hidden)), dim=-1))
        rope = self.rotary.angles(positions)
        hidden, residual = self.mtp_block(rope, x, None, kv_cache, meta, expert_capacity)
        return self.shared_head.norm.add_and_norm(hidden, residual)[0]

    def join_expert_parallel(self, capacity: int) -> None:
        """A step without tokens on this rank: the MoE's expert exchange (expert parallelism),
        as `DeepseekForCausalLM.join_expert_parallel` for the main layers."""
        mlp = self.mtp_block.mlp
        if hasattr(mlp, "join_expert_parallel"):  # an MoE layer
            mlp.join_expert_parallel(capacity)
