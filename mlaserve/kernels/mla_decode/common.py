"""Constants and host-side arithmetic shared by the plan and the kernels of the paged MLA decode.

Pure Python (and torch dtypes): importing this module needs no Triton, so the plan can be made
where Triton is missing. The device-side split arithmetic is `splits.split_bounds`.

Split arithmetic: request b with N_b keys is cut into `num_splits` contiguous runs of whole
tiles of block_n keys, each split_len = max(min_split_len, round_up(ceil(N_b / num_splits),
block_n)) keys long (min_split_len itself a multiple of block_n), so any split count is valid
for any lengths and splits past the end are empty. With balanced splits the split length is at
least a length L planned on the device once a step from the actual lengths (`split_plan.py`,
`MLADecodePlan.split_slots`), so a long request of a ragged batch takes more of the grid's
splits than a short one, short batches are not cut for the bound's length, and one grid (one
CUDA graph) serves them all.
"""

import functools
from typing import NamedTuple

import torch

# Names of the split-pass kernels a plan can choose (`MLADecodePlan.kernel`), each also the name
# of the module here whose `launch_split_pass(plan, SplitPassIO)` launches it.
TRITON_SPLIT = "triton_split"  # `triton_split._mla_decode_split_kernel`, any CUDA GPU or CPU
# `gluon_sm90._mla_decode_split_kernel_sm90`, sm_90 only, 64-row programs over a 16-bit cache
# or (`MLADecodePlan.fp8_staging`) an FP8 one
GLUON_SM90 = "gluon_sm90"
# `gluon_sm90_fp8._mla_decode_split_kernel_sm90_fp8`, sm_90 and an FP8 cache only
GLUON_SM90_FP8 = "gluon_sm90_fp8"
# `gluon_sm90_fp8_transposed._mla_decode_split_kernel_sm90_fp8_transposed`: the same problem,
# both products transposed (the 16 query rows as wgmma's N), sm_90 and an FP8 cache only
GLUON_SM90_FP8_T = "gluon_sm90_fp8_transposed"
KERNELS = (TRITON_SPLIT, GLUON_SM90, GLUON_SM90_FP8, GLUON_SM90_FP8_T)

LOG2E = 1.4426950408889634  # scores are computed in base 2: qk_scale = softmax_scale * LOG2E
MAX_MERGE_CHUNK = 64  # most splits the merge kernel reads in one load

GLUON_BLOCK_M = 64  # query rows per program of the Gluon pass
GLUON_SHARED_MEMORY_LIMIT = 227 * 1024  # bytes of shared memory per block on sm_90
_GLUON_DTYPES = (torch.bfloat16, torch.float16)
GLUON_FP8_ROWS = 16  # query rows per program of the FP8 Gluon pass
GLUON_FP8_CHUNK = 128  # latent columns per chunk of the FP8 Gluon pass (4 chunks: L = 512)
GLUON_FP8_TRANSPOSED_TILE = 64  # keys per tile of the transposed FP8 pass: wgmma's M


def next_pow2(value: int) -> int:
    """The least power of two >= value (1 for value <= 1)."""
    return 1 << max(0, value - 1).bit_length()


def whole_tiles(num_tokens: int, block_n: int) -> int:
    """num_tokens (at least 1) rounded up to whole tiles of block_n: splits start on tile
    boundaries, so a tile never straddles a page."""
    return -(-max(num_tokens, 1) // block_n) * block_n


def gluon_shared_memory_bytes(kv_lora_rank: int, rope_dim: int, block_n: int,
                              num_stages: int, fp8_stages: int = 0) -> int:
    """Shared memory of the Gluon pass: Q [64, L + R] plus num_stages KV tiles
    [block_n, L + R] (16-bit), fp8_stages FP8 tiles of the same shape (over an FP8 cache),
    plus 8 KB for the row statistics, barriers and layout-conversion scratch."""
    head_dim = kv_lora_rank + rope_dim
    return (2 * head_dim * (GLUON_BLOCK_M + num_stages * block_n)
            + head_dim * fp8_stages * block_n + 8192)


def gluon_serves(capability: tuple[int, int] | None, dtype: torch.dtype, kv_lora_rank: int,
                 rope_dim: int, block_m: int, block_n: int, num_stages: int,
                 block_size: int, fp8_stages: int = 0) -> bool:
    """Whether the Gluon pass serves the shape: sm_90, 16-bit data, L = 512 (two halves of 256
    columns), 64 <= R <= 256 (P [64, block_n] fits in a tile's rope buffer), 64-row programs,
    32-token tiles within a page, an even ring of tiles (pairs) in shared memory. Over an FP8
    cache (fp8_stages > 0, the FP8 tiles staged before conversion) the ring may be odd: the
    staging ring takes the room of a fourth tile."""
    ring = num_stages >= 2 and (num_stages % 2 == 0 or fp8_stages > 0)
    return (capability == (9, 0) and dtype in _GLUON_DTYPES and kv_lora_rank == 512
            and 64 <= rope_dim <= 256 and block_m == GLUON_BLOCK_M and block_n == 32
            and block_n <= block_size and ring
            and gluon_shared_memory_bytes(kv_lora_rank, rope_dim, block_n, num_stages,
                                          fp8_stages) <= GLUON_SHARED_MEMORY_LIMIT)


def gluon_fp8_shared_memory_bytes(kv_lora_rank: int, rope_dim: int, block_n: int,
                                  num_stages: int) -> int:
    """Shared memory of the FP8 Gluon pass: num_stages FP8 tiles [block_n, L + R], their
    float16 copy, Q [16, L + R] in float16, the scratch of P's layout change [16, block_n]
    float16, and the ready barriers (one per piece of a tile, 5 per ring slot: 8 bytes each,
    each allocation aligned to 16) with room for alignment."""
    head_dim = kv_lora_rank + rope_dim
    barriers = 5 * (8 * num_stages + 16)
    return (head_dim * (num_stages * block_n + 2 * block_n + 2 * GLUON_FP8_ROWS)
            + 2 * GLUON_FP8_ROWS * block_n + barriers + 64)


def _fp8_pass_problem(capability: tuple[int, int] | None, dtype: torch.dtype,
                      cache_dtype: torch.dtype, rows: int, kv_lora_rank: int,
                      rope_dim: int) -> bool:
    """The problem both FP8 Gluon passes solve: sm_90, 16-bit q over a float8_e4m3fn cache,
    at most 16 query rows, L = 4 x 128, R = 64."""
    return (capability == (9, 0) and dtype in _GLUON_DTYPES
            and cache_dtype == torch.float8_e4m3fn and rows <= GLUON_FP8_ROWS
            and kv_lora_rank == 4 * GLUON_FP8_CHUNK and rope_dim == 64)


def gluon_fp8_serves(capability: tuple[int, int] | None, dtype: torch.dtype,
                     cache_dtype: torch.dtype, rows: int, kv_lora_rank: int, rope_dim: int,
                     block_n: int, num_stages: int, block_size: int) -> bool:
    """Whether the FP8 Gluon pass serves the shape: sm_90, 16-bit q over a float8_e4m3fn
    cache, at most 16 query rows, L = 4 x 128, R = 64, tiles of 32 or 64 tokens within a page
    (the score layout spans 32 columns over the 4 warps: a 16-token tile would repeat half
    of every warp's work), 2 or more tiles in the ring, within the shared memory of a block."""
    return (_fp8_pass_problem(capability, dtype, cache_dtype, rows, kv_lora_rank, rope_dim)
            and block_n in (32, 64) and block_n <= block_size and num_stages >= 2
            and gluon_fp8_shared_memory_bytes(kv_lora_rank, rope_dim, block_n, num_stages)
            <= GLUON_SHARED_MEMORY_LIMIT)


def gluon_fp8_transposed_shared_memory_bytes(kv_lora_rank: int, rope_dim: int,
                                             num_stages: int) -> int:
    """Shared memory of the transposed FP8 pass: num_stages FP8 tiles [64, L + R], Q [16, L + R]
    in float16, P^T [16, 64] in float16, and 8 KB for the ready / empty barriers and the
    compiler's scratch (the column max across the warps, the output's change of layout)."""
    head_dim = kv_lora_rank + rope_dim
    return (head_dim * (num_stages * GLUON_FP8_TRANSPOSED_TILE + 2 * GLUON_FP8_ROWS)
            + 2 * GLUON_FP8_ROWS * GLUON_FP8_TRANSPOSED_TILE + 8192)


def gluon_fp8_transposed_serves(capability: tuple[int, int] | None, dtype: torch.dtype,
                                cache_dtype: torch.dtype, rows: int, kv_lora_rank: int,
                                rope_dim: int, block_n: int, num_stages: int,
                                block_size: int) -> bool:
    """Whether the transposed FP8 pass serves the shape: sm_90, 16-bit q over a
    float8_e4m3fn cache, at most 16 query rows, L = 4 x 128, R = 64, its 64-key tiles
    (block_n) and pages of a multiple of them, 2 or more tiles in the ring, within the shared
    memory of a block."""
    return (_fp8_pass_problem(capability, dtype, cache_dtype, rows, kv_lora_rank, rope_dim)
            and block_n == GLUON_FP8_TRANSPOSED_TILE
            and block_size % GLUON_FP8_TRANSPOSED_TILE == 0 and num_stages >= 2
            and gluon_fp8_transposed_shared_memory_bytes(kv_lora_rank, rope_dim, num_stages)
            <= GLUON_SHARED_MEMORY_LIMIT)


class SplitPassIO(NamedTuple):
    """What a split pass reads and writes, as `launch.mla_decode_triton` checked and allocated
    it; every pass's `launch_split_pass(plan, io)` takes it (a NamedTuple: it is built once a
    layer, and is cheaper to build than a frozen dataclass).

    q: [B * q_len, H, L + R] absorbed queries `[q_latent | q_pe]`, the last dim contiguous
    (16-bit for the Gluon passes; contiguous and 16-byte aligned for `GLUON_SM90`, which reads
    it by TMA). kv_cache: [num_blocks, block_size, L + R] in q's dtype or float8_e4m3fn, the last
    dim contiguous, its pages back to back where the pass loads tiles by TMA. block_table:
    [B, max_blocks] int32, row-contiguous. seq_lens: [B] int32. partial_o, partial_lse:
    [B, num_splits, q_len * H, L] and [B, num_splits, q_len * H] (flat): the partials, or with
    one split the final o (q's dtype) and lse. qk_scale: softmax_scale * log2(e).
    kv_lora_rank: L. q_len: new tokens per request. split_len: [1] int32, the step's least
    split length with balanced splits (`launch.plan_split_len`), else None.
    """

    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    partial_o: torch.Tensor
    partial_lse: torch.Tensor
    qk_scale: float
    kv_lora_rank: int
    q_len: int
    split_len: torch.Tensor | None = None


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device; None off CUDA."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


__all__ = ["GLUON_BLOCK_M", "GLUON_FP8_CHUNK", "GLUON_FP8_ROWS", "GLUON_FP8_TRANSPOSED_TILE",
           "GLUON_SHARED_MEMORY_LIMIT", "GLUON_SM90", "GLUON_SM90_FP8", "GLUON_SM90_FP8_T",
           "KERNELS", "LOG2E", "MAX_MERGE_CHUNK", "SplitPassIO", "TRITON_SPLIT",
           "device_capability", "gluon_fp8_serves", "gluon_fp8_shared_memory_bytes",
           "gluon_fp8_transposed_serves", "gluon_fp8_transposed_shared_memory_bytes",
           "gluon_serves", "gluon_shared_memory_bytes", "next_pow2", "whole_tiles"]
