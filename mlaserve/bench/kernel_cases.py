"""Inputs of one sweep cell, built by the shared harness (`mlaserve.kernels.testing`).

Inputs: `poisoned_paged_batch` at the cell's size: random q and a paged latent cache whose block
table is a random permutation of the pool's pages; every page no request uses, and the tail of
each request's last page, hold NaN, so a kernel that reads past a request's length cannot pass.
On a GPU the (q, cache) pair is cloned until the copies one round of calls touches exceed twice
the L2 cache, and calls rotate over the copies, so timings are of device memory, not of L2.

Every backend's output is checked against the float32 reference (`testing.compare`) before it
is timed, never against another fast kernel.
"""

import math
from dataclasses import dataclass

import torch

from mlaserve.bench.kernel_grid import Cell, decode_bytes
from mlaserve.kernels.reference import mla_decode_reference
from mlaserve.kernels.testing import l2_bytes, poisoned_paged_batch

MAX_COPIES = 512  # at most this many copies of a cell's inputs


@dataclass
class CellInputs:
    """One cell's tensors. Copies are identical, so every call's output equals the reference.

    queries: copies of q [B * q_len, H, L + R].
    caches: copies of the cache [num_blocks, block_size, L + R].
    block_table: [B, blocks_per_seq] int32, a random permutation of pages.
    seq_lens: [B] int32, `cell.seq_lens()` (all kv_len, or drawn when the cell is ragged).
    ref_o: [B * q_len, H, L] float32 reference output; ref_lse: [B * q_len, H] float32.
    """

    queries: list[torch.Tensor]
    caches: list[torch.Tensor]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    ref_o: torch.Tensor
    ref_lse: torch.Tensor

    @property
    def num_copies(self) -> int:
        return len(self.caches)


def copies_needed(cell: Cell, kv_lora_rank: int, rope_dim: int, element_size: int,
                  device: torch.device) -> int:
    """Copies so that one rotation touches more than twice the L2 (1 off the GPU)."""
    if device.type != "cuda":
        return 1
    touched = decode_bytes(cell, kv_lora_rank, rope_dim, element_size)
    return max(1, min(MAX_COPIES, math.ceil(2 * l2_bytes(device) / touched)))


def make_inputs(cell: Cell, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                device: torch.device, softmax_scale: float, num_copies: int,
                seed: int, kv_cache_dtype: torch.dtype | None = None) -> CellInputs:
    """Poisoned inputs for `cell` (see the module docstring) and their float32 reference; the
    cache in kv_cache_dtype (FP8) when given, which the reference dequantizes.

    The block table is exactly as wide as the longest request's pages (a backend's plan bounds
    the lengths by its width); an eighth of the pool (at least 2 pages) is spare NaN pages.
    """
    lengths = cell.seq_lens()
    used = sum(-(-n // cell.block_size) for n in lengths)
    q, cache, block_table, seq_lens = poisoned_paged_batch(
        lengths, cell.num_heads, kv_lora_rank, rope_dim,
        cell.block_size, cell.q_len, dtype, seed, spare_pages=max(2, used // 8), device=device,
        padding_columns=0, draw_on_device=True, kv_cache_dtype=kv_cache_dtype)
    ref_o, ref_lse = mla_decode_reference(q, cache, block_table, seq_lens, softmax_scale,
                                          kv_lora_rank, cell.q_len)
    caches = [cache] + [cache.clone() for _ in range(num_copies - 1)]
    queries = [q] + [q.clone() for _ in range(num_copies - 1)]
    return CellInputs(queries, caches, block_table, seq_lens, ref_o, ref_lse)
