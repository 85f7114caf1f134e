"""The shared comparator (`mlaserve.kernels.testing.compare`) catches a kernel that drops one key,
one page or one split, and passes the float32 reference and an exact kernel (CPU only).

The faulty outputs are built from the reference itself: the float32 reference of the same batch
with some keys of one request removed, cast to the dtype under test, is exactly what a kernel that
skips those keys (an off-by-one at a page end, a page-table slip, a split the merge never reads)
would return, up to rounding.
"""

import math

import pytest
import torch

from mlaserve.attention import mla_decode
from mlaserve.kernels.mla_decode.common import whole_tiles
from mlaserve.kernels.reference import mla_decode_reference
from mlaserve.kernels.testing import TOLERANCES, compare, poisoned_paged_batch

L, R, HEADS, BLOCK = 512, 64, 16, 64
SCALE = 1 / math.sqrt(128 + R)
# The case: request 3 has 3,089 keys (48 pages + 17); request 1 has none.
LENGTHS = [100, 0, 1, 3089]
LONG = 3


@pytest.fixture(scope="module")
def batch():
    """(q, cache, block_table, seq_lens) float32 poisoned batch and its reference (o, lse)."""
    q, cache, table, lens = poisoned_paged_batch(LENGTHS, HEADS, L, R, BLOCK, 1, torch.float32,
                                                 seed=11)
    return (q, cache, table, lens), mla_decode_reference(q, cache, table, lens, SCALE, L)


def without_keys(batch, request: int, dropped: range) -> torch.Tensor:
    """The reference output [B, H, L] with keys `dropped` of `request` left out."""
    (q, cache, table, lens), (ref_o, _) = batch
    num_keys = int(lens[request])
    pages = table[request, : -(-num_keys // BLOCK)].long()
    rows = cache[pages].reshape(-1, L + R)[:num_keys]  # [N, L + R], the request's keys in order
    keep = torch.ones(num_keys, dtype=torch.bool)
    keep[list(dropped)] = False
    kept = rows[keep]  # [N', L + R] as one page
    o, _ = mla_decode_reference(q[request : request + 1], kept[None], torch.zeros(1, 1,
                                dtype=torch.int32), torch.tensor([len(kept)]), SCALE, L)
    faulty = ref_o.clone()
    faulty[request] = o[0]
    return faulty


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_passes_the_reference_and_an_exact_kernel(batch, dtype):
    (q, cache, table, lens), (ref_o, ref_lse) = batch
    result = compare(ref_o.to(dtype), ref_lse, ref_o, ref_lse, dtype)
    assert result.passed, result.message
    assert result.metrics["cos_gap"] <= TOLERANCES[dtype].cos_gap
    o, lse = mla_decode(q.to(dtype), cache.to(dtype), table, lens, SCALE, kv_lora_rank=L,
                        backend="torch", return_lse=True)
    # the torch backend on the dtype's inputs, against the reference of those same inputs
    ref16 = mla_decode_reference(q.to(dtype), cache.to(dtype), table, lens, SCALE, L)
    assert compare(o, lse, *ref16, dtype).passed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fault", ["last_key", "first_key", "last_3_keys", "one_page",
                                   "one_split"])
def test_catches_a_dropped_key_page_or_split(batch, dtype, fault):
    (_, _, _, lens), (ref_o, ref_lse) = batch
    num_keys = int(lens[LONG])
    split_len = whole_tiles(-(-num_keys // 4), 32)  # 4 splits of 32-token tiles: 800 keys
    dropped = {"last_key": range(num_keys - 1, num_keys), "first_key": range(1),
               "last_3_keys": range(num_keys - 3, num_keys),
               "one_page": range(20 * BLOCK, 21 * BLOCK),
               "one_split": range(2 * split_len, 3 * split_len)}[fault]
    faulty = without_keys(batch, LONG, dropped).to(dtype)
    result = compare(faulty, ref_lse, ref_o, ref_lse, dtype)
    assert not result.passed and "min cos" in result.message, result
    if fault == "last_3_keys" and dtype == torch.bfloat16:
        # The bounds this comparator replaced (atol = rtol = 1e-2, 1 - cos <= 1e-3) let it pass.
        assert result.metrics["cos_gap"] < 1e-3
        torch.testing.assert_close(faulty.float(), ref_o, atol=1e-2, rtol=1e-2)


def test_names_each_kind_of_wrong_output(batch):
    (_, _, _, _), (ref_o, ref_lse) = batch
    f32 = torch.float32
    has_keys = torch.isfinite(ref_lse)[..., None]  # [B, H, 1]
    noisy = ref_o + 1e-7 * torch.randn_like(ref_o) * has_keys
    assert compare(noisy, ref_lse, ref_o, ref_lse, f32).passed
    nan = ref_o.clone()
    nan[0, 0, 0] = float("nan")
    assert "non-finite" in compare(nan, ref_lse, ref_o, ref_lse, f32).message
    one_row = ref_o.clone()
    one_row[0, 1] = torch.randn(L)  # one (token, head) wrong
    assert "min cos" in compare(one_row, ref_lse, ref_o, ref_lse, f32).message
    empty_row = ref_o.clone()
    empty_row[1, 0, 0] = 1e-3  # request 1 has no key: its rows must be exactly 0
    assert "no keys are not 0" in compare(empty_row, ref_lse, ref_o, ref_lse, f32).message
    finite = ref_lse.clone()
    finite[1] = 0.0  # lse of a row without keys must be -inf
    assert "-inf" in compare(ref_o, finite, ref_o, ref_lse, f32).message
    base2 = compare(ref_o, ref_lse / math.log(2), ref_o, ref_lse, f32)
    assert not base2.passed and "natural log" in base2.message
    assert "dtype" in compare(ref_o.half(), ref_lse, ref_o, ref_lse, f32).message
    assert "shape" in compare(ref_o[:1], ref_lse, ref_o, ref_lse, f32).message
    assert compare(ref_o, None, ref_o, ref_lse, f32).passed  # no LSE given
    assert set(TOLERANCES) == {torch.bfloat16, torch.float16, torch.float32}
