"""The split arithmetic on the device (`common.py` has it in words): one Triton function, called
by every split pass (the Triton kernel of `triton_split.py` and the Gluon passes), so none
imports another."""

import triton
import triton.language as tl


@triton.jit
def split_bounds(seq_len, split, num_splits, min_split_len, BLOCK_N: tl.constexpr,
                 balanced_len=0):
    """KV positions [split_start, split_end) of one split of a request of seq_len keys, and the
    split length: max(min_split_len, round_up(max(ceil(seq_len / num_splits), balanced_len),
    BLOCK_N)). balanced_len (balanced splits; 0 otherwise) is the batch's keys over
    the splits a uniform batch would use, so long requests of a ragged batch take more splits
    than short ones."""
    split_len = tl.maximum(tl.cdiv(seq_len, num_splits), balanced_len)
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, min_split_len)
    split_start = split * split_len
    return split_len, split_start, tl.minimum(split_start + split_len, seq_len)


__all__ = ["split_bounds"]
