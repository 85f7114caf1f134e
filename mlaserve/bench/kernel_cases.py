"""Inputs of one sweep cell and the correctness gate every backend passes before it is timed.

Inputs: random q and a paged latent cache whose block table is a random permutation of the pool's
pages; every page no request uses, and the tail of each request's last page, hold NaN, so a
kernel that reads past a request's length cannot pass. On a GPU the (q, cache) pair is cloned
until the copies one round of calls touches exceed twice the L2 cache, and calls rotate over the
copies, so timings are of device memory, not of L2.

Gate: the backend's output against the float32 reference `mla_decode_reference` (never against
another fast kernel), by relative Frobenius error, the least per-row cosine similarity, and the
natural-log LSE (absolute error; -inf exactly where the reference has no keys).
"""

import math
from dataclasses import dataclass

import torch

from mlaserve.bench.kernel_grid import Cell, decode_bytes
from mlaserve.kernels.reference import mla_decode_reference

# L2 size assumed when the device does not report one (an H200 has 60 MB).
DEFAULT_L2_BYTES = 60 * 1024 * 1024
MAX_COPIES = 512


@dataclass(frozen=True)
class Tolerance:
    """Gate bounds for one dtype."""

    rel_err: float  # ||o - ref|| / ||ref||
    cos_gap: float  # 1 - least per-row cosine similarity
    lse_err: float  # max |lse - ref_lse| over rows with keys


TOLERANCES = {
    torch.bfloat16: Tolerance(rel_err=8e-3, cos_gap=1e-3, lse_err=1e-2),
    torch.float16: Tolerance(rel_err=2e-3, cos_gap=1e-4, lse_err=1e-2),
    torch.float32: Tolerance(rel_err=1e-3, cos_gap=1e-5, lse_err=5e-3),  # tf32 dots allowed
}


@dataclass
class CellInputs:
    """One cell's tensors. Copies are identical, so every call's output equals the reference.

    queries: copies of q [B * q_len, H, L + R].
    caches: copies of the cache [num_blocks, block_size, L + R].
    block_table: [B, blocks_per_seq] int32, a random permutation of pages.
    seq_lens: [B] int32, all kv_len.
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


def l2_bytes(device: torch.device) -> int:
    """The device's L2 size (DEFAULT_L2_BYTES when unknown)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def copies_needed(cell: Cell, kv_lora_rank: int, rope_dim: int, element_size: int,
                  device: torch.device) -> int:
    """Copies so that one rotation touches more than twice the L2 (1 off the GPU)."""
    if device.type != "cuda":
        return 1
    touched = decode_bytes(cell, kv_lora_rank, rope_dim, element_size)
    return max(1, min(MAX_COPIES, math.ceil(2 * l2_bytes(device) / touched)))


def make_inputs(cell: Cell, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                device: torch.device, softmax_scale: float, num_copies: int,
                seed: int) -> CellInputs:
    """Random inputs for `cell` (see the module docstring) and their float32 reference."""
    generator = torch.Generator(device=device).manual_seed(seed)
    head_dim = kv_lora_rank + rope_dim
    width = cell.blocks_per_seq
    used = cell.batch_size * width
    num_blocks = used + max(2, used // 8)  # spare pages stay NaN
    perm = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32)
    block_table = perm[:used].view(cell.batch_size, width)  # [B, width]
    cache = torch.randn(num_blocks, cell.block_size, head_dim, generator=generator,
                        device=device, dtype=dtype)
    cache[perm[used:].long()] = float("nan")
    tail = width * cell.block_size - cell.kv_len
    if tail:
        cache[block_table[:, -1].long(), cell.block_size - tail:] = float("nan")
    q = torch.randn(cell.batch_size * cell.q_len, cell.num_heads, head_dim,
                    generator=generator, device=device, dtype=dtype)
    seq_lens = torch.full((cell.batch_size,), cell.kv_len, dtype=torch.int32, device=device)
    ref_o, ref_lse = mla_decode_reference(q, cache, block_table, seq_lens, softmax_scale,
                                          kv_lora_rank, cell.q_len)
    caches = [cache] + [cache.clone() for _ in range(num_copies - 1)]
    queries = [q] + [q.clone() for _ in range(num_copies - 1)]
    return CellInputs(queries, caches, block_table, seq_lens, ref_o, ref_lse)


@dataclass
class GateResult:
    """Whether an output passed the gate, its error metrics, and why it failed."""

    passed: bool
    metrics: dict[str, float]
    message: str = ""


def check_output(o: torch.Tensor, lse: torch.Tensor | None, ref_o: torch.Tensor,
                 ref_lse: torch.Tensor, dtype: torch.dtype) -> GateResult:
    """Compare o [T, H, L] (and lse [T, H], natural log) with the float32 reference.

    `lse` None means the backend returns none; only o is then checked.
    """
    if tuple(o.shape) != tuple(ref_o.shape):
        return GateResult(False, {}, f"output shape {tuple(o.shape)} != {tuple(ref_o.shape)}")
    if o.dtype != dtype:
        return GateResult(False, {}, f"output dtype {o.dtype} != {dtype}")
    tol = TOLERANCES[dtype]
    out = o.float()
    if not bool(torch.isfinite(out).all()):
        return GateResult(False, {}, "non-finite values in the output (NaN pages read?)")
    ref_norm = ref_o.norm()
    rel_err = float((out - ref_o).norm() / ref_norm.clamp_min(1e-30))
    rows, ref_rows = out.flatten(0, 1), ref_o.flatten(0, 1)  # [T * H, L]
    row_norm, ref_row_norm = rows.norm(dim=-1), ref_rows.norm(dim=-1)
    has_keys = ref_row_norm > 0
    cos = (rows * ref_rows).sum(-1) / (row_norm * ref_row_norm).clamp_min(1e-30)
    cos_gap = float(1 - cos[has_keys].min()) if bool(has_keys.any()) else 0.0
    stray = float(rows[~has_keys].abs().max()) if bool((~has_keys).any()) else 0.0
    metrics = {"rel_err": rel_err, "cos_gap": cos_gap}
    problems = []
    if rel_err > tol.rel_err:
        problems.append(f"rel_err {rel_err:.2e} > {tol.rel_err:.0e}")
    if cos_gap > tol.cos_gap:
        problems.append(f"1 - min cos {cos_gap:.2e} > {tol.cos_gap:.0e}")
    if stray > 0:
        problems.append(f"rows with no keys are not 0 (max |o| {stray:.2e})")
    if lse is not None:
        lse = lse.float()
        empty = torch.isneginf(ref_lse)
        if tuple(lse.shape) != tuple(ref_lse.shape):
            problems.append(f"lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}")
        elif bool(torch.isnan(lse).any()) or not bool((torch.isneginf(lse) == empty).all()):
            problems.append("lse is NaN, or -inf where the reference is not (or not where it is)")
        else:
            lse_err = float((lse - ref_lse)[~empty].abs().max()) if bool((~empty).any()) else 0.0
            metrics["lse_err"] = lse_err
            if lse_err > tol.lse_err:
                problems.append(f"lse error {lse_err:.2e} > {tol.lse_err:.0e} "
                                "(natural log expected)")
    return GateResult(not problems, metrics, "; ".join(problems))
