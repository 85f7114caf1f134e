"""The `torch` backend: gather the pages and do the math in float32. The oracle and the CPU path."""

import torch

from mlaserve.attention.base import BackendCapabilities, MLABackend


class TorchMLABackend(MLABackend):
    """Padded gather + float32 einsum; memory O(B * max_len * (L + R)), chunked over the batch."""

    name = "torch"
    capabilities = BackendCapabilities(
        device_types=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        fp8_kv_cache=True,  # the pages are gathered into float32 (dequantized) either way
        supports_cuda_graphs=True,
        graph_lengths_on_device=True,
    )
    auto_priority = 0
    # Bound the float32 gather to about this many cache rows at a time.
    max_rows_per_chunk = 1 << 20

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int = 1) -> None:
        self.block_table = block_table
        self.seq_lens = seq_lens
        self.q_len = q_len

    def run(self, q, kv_cache, return_lse=False):
        o, lse = torch_mla_decode(q, kv_cache, self.block_table, self.seq_lens,
                                  self.softmax_scale, self.shape.kv_lora_rank, self.q_len,
                                  self.max_rows_per_chunk)
        o = o.to(q.dtype)
        return (o, lse) if return_lse else o


def torch_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    q_len: int,
    max_rows_per_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched float32 paged decode with no host sync; same contract as `mla_decode_reference`.

    Returns o [B * q_len, H, L] float32 and lse [B * q_len, H] float32.
    """
    batch, max_blocks = block_table.shape
    block_size = kv_cache.shape[1]
    num_heads = q.shape[1]
    max_len = max_blocks * block_size
    chunk = max(1, max_rows_per_chunk // max(max_len, 1))
    outs, lses = [], []
    for start in range(0, batch, chunk):
        table = block_table[start : start + chunk].long()
        lens = seq_lens[start : start + chunk].long()
        n = table.shape[0]
        kv = kv_cache[table].reshape(n, max_len, -1).float()  # [n, max_len, L + R]
        key_pos = torch.arange(max_len, device=q.device)
        valid = key_pos[None, :] < lens[:, None]  # [n, max_len]
        kv = torch.where(valid[..., None], kv, 0.0)  # unused pages may hold NaN
        rows = q[start * q_len : (start + n) * q_len].float()
        rows = rows.view(n, q_len * num_heads, -1)  # [n, q_len * H, L + R]
        scores = torch.bmm(rows, kv.transpose(1, 2)) * softmax_scale  # [n, q_len * H, max_len]
        scores = scores.view(n, q_len, num_heads, max_len)  # [n, q_len, H, max_len]
        query_pos = lens[:, None] - q_len + torch.arange(q_len, device=q.device)  # [n, q_len]
        visible = key_pos[None, None, :] <= query_pos[..., None]  # [n, q_len, max_len]
        visible = visible & valid[:, None, :]
        scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [n, q_len, H]
        probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        probs = probs.view(n, q_len * num_heads, max_len)  # [n, q_len * H, max_len]
        out = torch.bmm(probs, kv[:, :, :kv_lora_rank])  # [n, q_len * H, L]
        outs.append(out.view(n * q_len, num_heads, kv_lora_rank))  # [n * q_len, H, L]
        lses.append(lse.view(n * q_len, num_heads))  # [n * q_len, H]
    return torch.cat(outs), torch.cat(lses)
