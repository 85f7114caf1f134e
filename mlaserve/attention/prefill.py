"""Expanded-MHA prefill: up-project the latents and run causal attention per prompt chunk.

Attention is torch's `scaled_dot_product_attention` on 4-d [1, H, S, dim] inputs, which lets
torch pick a fused kernel (memory-efficient on CUDA, flash on CPU); 3-d inputs would send it to
the unfused math path (float32 score matrices). cuDNN's kernel is left out: it builds an
execution plan for every new shape, tens of milliseconds each time a prompt length is met for
the first time, which one user's time to first token pays in full. A chunk with cached context
attends bottom-right aligned: query i of n sees keys 0 .. context_len + i.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from mlaserve.attention.metadata import PrefillChunk

# the fused kernels prefill may use, in torch's order of preference (no cuDNN: see above)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def expanded_prefill(
    q: torch.Tensor,
    latent: torch.Tensor,
    kv_cache_flat: torch.Tensor,
    chunk: PrefillChunk,
    kv_b_weight: torch.Tensor,
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    kv_lora_rank: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Causal attention of one chunk over its cached context plus itself.

    Args:
        q: [n, H, P + R] queries of the chunk (rope applied).
        latent: [n, L + R] the chunk's new latents [c_kv | k_pe] (rope applied).
        kv_cache_flat: [num_slots, L + R] this layer's cache viewed flat.
        kv_b_weight: [H * (P + V), L] the kv_b_proj weight.

    Returns:
        [n, H, V] attention output.
    """
    n = q.shape[0]
    if chunk.context_slots is not None and chunk.context_len:
        # an FP8 cache is read back dequantized; the chunk's own latents stay exact (as in
        # vLLM), so a prompt prefilled in one chunk scores as with a model-dtype cache
        context = kv_cache_flat[chunk.context_slots].to(latent.dtype)  # [ctx, L + R]
        latent = torch.cat((context, latent))  # [ctx + n, L + R]
    num_keys = latent.shape[0]
    kv = F.linear(latent[:, :kv_lora_rank], kv_b_weight)
    kv = kv.view(num_keys, num_heads, qk_nope_head_dim + v_head_dim)  # [S, H, P + V]
    k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
    k_pe = latent[:, None, kv_lora_rank:].expand(-1, num_heads, -1)  # [S, H, R]
    k = torch.cat((k_nope, k_pe), dim=-1)  # [S, H, P + R]
    mask = causal_lower_right(n, num_keys) if num_keys > n else None
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, *, d]
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=softmax_scale)
    return out[0].transpose(0, 1)  # [1, H, n, V] -> [n, H, V]
