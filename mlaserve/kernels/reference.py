"""Float32 torch references for the kernels in this package. Slow, simple, and the oracle."""

import torch


def mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    q_len: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode attention in float32.

    Args:
        q: [B * q_len, H, L + R] absorbed queries ([q_latent | q_pe]), request-major rows.
        kv_cache: [num_blocks, block_size, L + R] latent cache ([c_kv | k_pe]); V is its
            first L columns.
        block_table: [B, max_blocks] int32, page ids of each request in order.
        seq_lens: [B] int32 KV length per request, including the q_len new tokens.
        softmax_scale: multiplies q.k before the softmax.
        kv_lora_rank: L, the width of c_kv (and of the output).
        q_len: new tokens per request; token t of request b sits at position seq_len - q_len + t
            and sees keys 0 .. seq_len - q_len + t (causal among the new tokens).

    Returns:
        o: [B * q_len, H, L] float32, zero for rows that see no key.
        lse: [B * q_len, H] float32 natural-log sum of exp(scores), -inf for rows that see no key.
    """
    num_rows, num_heads, _ = q.shape
    batch = block_table.shape[0]
    block_size = kv_cache.shape[1]
    o = torch.zeros(num_rows, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((num_rows, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        seq_len = int(seq_lens[b])
        if seq_len == 0:
            continue
        num_pages = (seq_len + block_size - 1) // block_size
        pages = block_table[b, :num_pages].long()
        kv = kv_cache[pages].reshape(num_pages * block_size, -1)[:seq_len].float()  # [N, L + R]
        rows = q[b * q_len : (b + 1) * q_len].float()  # [q_len, H, L + R]
        scores = torch.einsum("thd,nd->thn", rows, kv) * softmax_scale  # [q_len, H, N]
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, N]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [q_len, H]
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out = torch.einsum("thn,nl->thl", probs, kv[:, :kv_lora_rank])
        o[b * q_len : (b + 1) * q_len] = out
        lse[b * q_len : (b + 1) * q_len] = row_lse
    return o, lse


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 without intermediate rounding.

    Args:
        x: [T, N]; weight: [N]. Returns [T, N] float32: x / sqrt(mean(x^2) + eps) * weight.
    """
    x = x.float()
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   interleaved: bool) -> torch.Tensor:
    """Rotary embedding as complex multiplication, in float32.

    Args:
        x: [T, ..., R]; cos, sin: [T, R / 2] float32 (the angles of each token).
        interleaved: pair i is (x_{2i}, x_{2i+1}) (DeepSeek), else (x_i, x_{i + R/2}) (neox).

    Returns:
        [T, ..., R] float32, pair i rotated by its angle and stored back in x's layout.
    """
    x = x.float().contiguous()
    half = x.shape[-1] // 2
    rotation = torch.complex(cos, sin).view(cos.shape[0], *([1] * (x.dim() - 2)), half)
    if interleaved:
        pairs = x.unflatten(-1, (half, 2))  # [T, ..., R/2, 2]
        return torch.view_as_real(torch.view_as_complex(pairs) * rotation).flatten(-2)
    rotated = torch.complex(x[..., :half], x[..., half:]) * rotation  # [T, ..., R/2]
    return torch.cat((rotated.real, rotated.imag), dim=-1)


def latent_rows_reference(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The latent cache rows of `kv_a_proj_with_mqa`'s output, in float32.

    Args:
        kv: [T, L + R] [c_kv | k_pe]; norm_weight: [L]; cos, sin: [T, R / 2] float32.

    Returns:
        [T, L + R] float32: [rmsnorm(c_kv) | rope(k_pe)].
    """
    kv_lora_rank = norm_weight.shape[0]
    c_kv, k_pe = kv[:, :kv_lora_rank], kv[:, kv_lora_rank:]
    return torch.cat((rms_norm_reference(c_kv, norm_weight, eps),
                      rope_reference(k_pe, cos, sin, interleaved)), dim=-1)
