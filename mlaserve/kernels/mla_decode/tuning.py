"""Tuned launch parameters of the paged MLA decode, as data: what `plan.default_config` picks
from. Measured on one H200 under CUDA-graph replay; how each value was chosen (the timings,
the runs that produced them) is in benchmarks/mla-decode-history.md, not here.
"""

# The Gluon sm_90 seesaw pass (`gluon_sm90.py`): 64-row programs, 32-token tiles x 4 buffers,
# one program per SM, at most 32 splits of 64 or more tokens. Chosen for more than 16 query
# rows with 16-bit data, L = 512, 64 <= R <= 256 and pages of 32 or more tokens; off sm_90 the
# Triton kernel runs the same tile.
GLUON_SM90_CONFIG = dict(block_m=64, block_n=32, num_warps=8, num_stages=4, programs_per_sm=1.0,
                         min_split_len=64, max_num_splits=32, tma_loads=True,
                         warp_specialized=True)
GLUON_MIN_PAGE = 32  # tokens per page the Gluon pass needs (one tile within a page)
# The same shapes over an FP8 cache: the Gluon pass with 2 FP8 tiles staged and converted into
# a ring of 3 (float16) tiles, what fits beside Q (faster than 1 staged tile, and 1.4-2.4x the
# Triton pass's best configuration, on an H100 at 128 heads; benchmarks/fp8/README.md).
FP8_CACHE_WIDE_ROWS_CONFIG = dict(GLUON_SM90_CONFIG, num_stages=3, fp8_stages=2)

# The FP8 Gluon pass (`gluon_sm90_fp8.py`) over an FP8 cache under 16-row programs:
# (block_n, num_stages), or None to read FP8 caches with the Triton split pass (TRITON_TILES).
GLUON_FP8_TILE: tuple[int, int] | None = (32, 2)
# The transposed FP8 pass (`gluon_sm90_fp8_transposed.py`, 64-key tiles), the FP8-cache default
# where pages hold whole tiles: its ring depth (3 was slower: one program an SM), or None to
# fall back to GLUON_FP8_TILE's pass.
GLUON_FP8_TRANSPOSED_STAGES: int | None = 2
# Its split count counts one program per SM, under either split policy: one program streams
# an SM's share of the cache, so fewer splits save their partials and merge (H100, 16 heads x
# kv 4096: 2 splits instead of 4 at batch 64, 1 instead of 2 at 128 and 512, 2-7% faster).
GLUON_FP8_TRANSPOSED_PROGRAMS_PER_SM = 1.0

# float32 inputs (tests under the interpreter, FMA dots on a GPU): 16-row groups, the widest
# tile of FLOAT32_BLOCK_NS whose Q and two KV tiles fit FLOAT32_SMEM_BUDGET.
FLOAT32_BLOCK_M = 16
FLOAT32_BLOCK_NS = (64, 32, 16)
FLOAT32_SMEM_BUDGET = 180 * 1024
FLOAT32_MIN_SPLIT_LEN = 64  # and at least two tiles

# Triton split pass, 16-bit data: (block_n, num_stages) per regime; `plan.default_config`
# decides the regime. Triton's pipeliner gives a 16- or 32-row program (mma.sync)
# num_stages - 1 KV buffers and a 64-row program (wgmma) num_stages.
TRITON_TILES: dict[str, tuple[int, int]] = {
    "small_pages": (0, 3),  # pages of 32-63 tokens: one page per tile (block_n = page)
    "gathered_pages": (32, 3),  # pages under 32 tokens: tiles of whole pages, ids read ahead
    "gathered_pages_fill": (64, 2),  # the same under the "fill" split policy (many requests)
    "one_per_sm": (64, 3),  # 16 rows x 32-255 requests of <= 1024 tokens, 8 warps (166 KB)
    "many_requests": (32, 3),  # 16 rows over >= 32 requests, or 64-token tiles do not fit
    "default": (64, 2),
}
TRITON_SMEM_BUDGET = 224 * 1024  # bytes for Q [block_m, L + R] plus two 64-token KV tiles
# Split counts: min_split_len per (block_m, long requests), programs per SM per policy.
MIN_SPLIT_LEN = {(16, False): 64, (16, True): 128, (32, False): 64, (32, True): 256,
                 (64, False): 256, (64, True): 256}
LONG_REQUEST_TOKENS = 2048  # max_seq_len above this counts as long
SHORT_REQUEST_TOKENS = 1024  # max_seq_len at most this counts as short
MEDIUM_BATCH = (32, 256)  # [low, high) requests: 16-bit partials, one program per SM
FILL_MIN_BATCH = 264  # 16 rows x long requests from this batch on: "fill" at 4 programs per SM
FILL_PROGRAMS_PER_SM = 4.0
# Balanced splits (`MLADecodeConfig.balanced_splits`; not a default until measured): the grid
# holds at least this many programs per slot (and the bound's own split count), so the split
# length planned on the device can give a ragged batch's long requests more splits.
BALANCED_GRID_PROGRAMS_PER_SLOT = 4
SMALL_BATCH_WIDE_HEADS = (64, 8)  # >= 64 heads and < 8 requests: 32-row groups, not 64
MERGE_ROW_ELEMENTS = 2048  # merge_block_rows * L at most this
