"""The torch backend (the batched CPU path) against the float32 reference, adversarial inputs."""

import pytest
import torch

from mlaserve.attention import mla_decode
from mlaserve.kernels.reference import mla_decode_reference


def make_case(lengths, block_size, num_heads, q_len, kv_lora_rank=32, rope=16, seed=0):
    """Shuffled pages, NaN in every unused page and in each last page's tail."""
    gen = torch.Generator().manual_seed(seed)
    dim = kv_lora_rank + rope
    pages = [-(-n // block_size) for n in lengths]
    total = sum(pages) + 3  # spare pages stay NaN
    cache = torch.full((total, block_size, dim), float("nan"))
    order = torch.randperm(total, generator=gen)
    width = max(max(pages), 1)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for b, (n, p) in enumerate(zip(lengths, pages, strict=True)):
        ids = order[used : used + p]
        used += p
        table[b, :p] = ids.int()
        rows = torch.randn(p * block_size, dim, generator=gen)
        rows[n:] = float("nan")
        cache[ids] = rows.view(p, block_size, dim)
    q = torch.randn(len(lengths) * q_len, num_heads, dim, generator=gen)
    return q, cache, table, torch.tensor(lengths, dtype=torch.int32), kv_lora_rank


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [1, 16, 128])
@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_torch_backend_matches_the_reference(block_size, num_heads, q_len):
    bs = block_size
    lengths = [q_len, bs - 1 if bs > q_len else q_len, bs, bs + 1, 3 * bs + 5, 0][:6]
    lengths = [n if n == 0 or n >= q_len else q_len for n in lengths]
    q, cache, table, seq_lens, rank = make_case(lengths, bs, num_heads, q_len)
    scale = 0.3
    o, lse = mla_decode(q, cache, table, seq_lens, scale, kv_lora_rank=rank, q_len=q_len,
                        backend="torch", return_lse=True)
    ref_o, ref_lse = mla_decode_reference(q, cache, table, seq_lens, scale, rank, q_len)
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    empty = slice(5 * q_len, 6 * q_len)  # the length-0 request
    assert (o[empty] == 0).all() and torch.isneginf(lse[empty]).all()
