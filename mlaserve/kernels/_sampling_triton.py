"""The Triton program behind `sampling.gumbel_argmax` (imported lazily: triton may be missing).

It reproduces `sampling.seeded_uniform` bit for bit in uint64 arithmetic (wrapping multiplies,
logical shifts), so the GPU and the torch path draw the same noise.
"""

import triton
import triton.language as tl


@triton.jit
def _mix(x):
    """splitmix64's finaliser on uint64."""
    x = x ^ (x >> 31)
    x = x * 0x9E3779B97F4A7C15
    x = x ^ (x >> 29)
    x = x * 0xBF58476D1CE4E5B9
    return x ^ (x >> 32)


# Per-row parameters are read once per program, so their alignment does not matter; not
# specialising on it keeps one compiled kernel (the engine passes views at odd offsets).
@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "seed_ptr", "position_ptr",
                                            "out_ptr"])
def gumbel_argmax_kernel(logits_ptr, row_stride, temperature_ptr, seed_ptr, position_ptr,
                         out_ptr, vocab_size, BLOCK: tl.constexpr):
    """One program per row: argmax_v(logits_v / T - log(-log u_v)), or argmax_v logits_v at T 0.

    logits [N, V] float32 (row stride given), temperature [N] float32, seeds / positions [N]
    int64, out [N] int64.
    """
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
    position = tl.load(position_ptr + row).to(tl.uint64, bitcast=True)
    row_key = _mix(seed * 1000003 + position * 7919 + 12345)
    sampling = temperature > 0
    inv_t = 1.0 / tl.where(sampling, temperature, 1.0)
    best_value = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    offsets = tl.arange(0, BLOCK)
    for start in range(0, vocab_size, BLOCK):
        cols = start + offsets
        valid = cols < vocab_size
        x = tl.load(logits_ptr + row * row_stride + cols, mask=valid, other=float("-inf"))
        x = x.to(tl.float32)
        bits = _mix(row_key ^ (cols.to(tl.uint64) * 0x9E3779B97F4A7C15))
        u = (((bits >> 41) & 0x7FFFFF).to(tl.float32) + 0.5) / 8388608.0  # uniform_from_bits
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(sampling, x * inv_t + gumbel, x)
        score = tl.where(valid, score, float("-inf"))
        better = score > best_value
        best_value = tl.where(better, score, best_value)
        best_index = tl.where(better, cols, best_index)
    top = tl.max(best_value, axis=0)
    # the smallest index among the lanes holding the maximum (argmax's tie rule)
    candidate = tl.where(best_value == top, best_index, vocab_size)
    tl.store(out_ptr + row, tl.min(candidate, axis=0).to(tl.int64))
