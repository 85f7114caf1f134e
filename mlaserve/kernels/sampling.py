"""Seeded sampling noise and the sort-free sampler (Gumbel-max over the whole vocabulary).

Noise is counter-based: the uniform draw for vocabulary index v of the token sampled at
position p of a request with seed s is a pure function of (s, p, v) (a splitmix64-style mixer),
so a seeded request samples the same tokens whatever else is in the batch and on any device.

Sampling at temperature T without top-k / top-p / min-p needs no sort and no softmax:
argmax_v(logits_v / T - log(-log u_v)) is a draw from softmax(logits / T) (the Gumbel-max
trick). On CUDA one Triton program per row streams its logits once, hashing the noise on the
fly; the torch version (CPU, and the reference) computes the same thing with [N, V] temporaries.
"""

import torch

SEED_MASK = (1 << 63) - 1  # seeds are kept below 2**63 (int64)
# splitmix64's multipliers, as signed int64 (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, ...)
_GOLDEN = -7046029254386353131
_MIX1 = -4658895280553007687


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A splitmix64-style integer mixer on int64 (wrapping arithmetic, logical shifts)."""
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    x = x * _GOLDEN
    x = x ^ ((x >> 29) & ((1 << 35) - 1))
    x = x * _MIX1
    return x ^ ((x >> 32) & ((1 << 32) - 1))


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise [N, V] float32, a pure function of (seed, position, vocab index).

    seeds, positions: [N] int64 (seeds below 2**63).
    """
    row = _mix(seeds * 1000003 + positions * 7919 + 12345)  # [N]
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix(row[:, None] ^ (cols[None, :] * _GOLDEN))  # [N, V]
    return uniform_from_bits(bits)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 random bits -> float32 in (0, 1), never 0 or 1: (m + 0.5) / 2**23 of the top 23
    bits m. (24 bits would round (2**24 - 0.5) / 2**24 up to 1.0 in float32, and the Gumbel
    noise -log(-log(u)) to +inf.) The Triton pass computes the same values."""
    mantissa = (bits >> 41) & ((1 << 23) - 1)  # 23 random bits
    return (mantissa.float() + 0.5) / float(1 << 23)


def gumbel_argmax_torch(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32, temperature [N] float32 (0: greedy), seeds, positions [N] int64
    -> sampled ids [N] int64."""
    gumbel = -torch.log(-torch.log(seeded_uniform(seeds, positions, logits.shape[-1])))
    inv_t = 1.0 / torch.where(temperature > 0, temperature, 1.0)
    sampled = (logits * inv_t[:, None] + gumbel).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, logits.argmax(dim=-1))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """As `gumbel_argmax_torch`; one Triton pass over the logits on CUDA."""
    if logits.device.type != "cuda":
        return gumbel_argmax_torch(logits, temperature, seeds, positions)
    return _gumbel_argmax_triton(logits, temperature, seeds, positions)


def _gumbel_argmax_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                          positions: torch.Tensor) -> torch.Tensor:
    from mlaserve.kernels._sampling_triton import gumbel_argmax_kernel

    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        gumbel_argmax_kernel[(num_rows,)](
            logits, logits.stride(0), temperature, seeds, positions, out, vocab, BLOCK=2048,
            num_warps=8)
    return out
