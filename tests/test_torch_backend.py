"""The torch backend (the batched CPU path) against the float32 reference, adversarial inputs."""

import pytest
import torch

from mlaserve.attention import mla_decode
from mlaserve.kernels.reference import mla_decode_reference
from mlaserve.kernels.testing import poisoned_paged_batch


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [1, 16, 128])
@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_torch_backend_matches_the_reference(block_size, num_heads, q_len):
    bs = block_size
    lengths = [q_len, bs - 1 if bs > q_len else q_len, bs, bs + 1, 3 * bs + 5, 0][:6]
    lengths = [n if n == 0 or n >= q_len else q_len for n in lengths]
    rank = 32
    q, cache, table, seq_lens = poisoned_paged_batch(lengths, num_heads, rank, 16, bs, q_len,
                                                     torch.float32)
    scale = 0.3
    o, lse = mla_decode(q, cache, table, seq_lens, scale, kv_lora_rank=rank, q_len=q_len,
                        backend="torch", return_lse=True)
    ref_o, ref_lse = mla_decode_reference(q, cache, table, seq_lens, scale, rank, q_len)
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    empty = slice(5 * q_len, 6 * q_len)  # the length-0 request
    assert (o[empty] == 0).all() and torch.isneginf(lse[empty]).all()
