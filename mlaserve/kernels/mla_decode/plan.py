"""The plan of a paged MLA decode step: which split-pass kernel runs, with which launch
configuration, how many splits, and the workspace sizes. The launcher (`launch.py`) obeys the
plan and decides nothing again.

Everything here is Python ints, dataclasses and the device's compute capability (batch size, an
upper bound on the KV length, SM count, page size), so planning a step never synchronises with
the device, and needs no Triton. The tuned numbers are data in `tuning.py`.
"""

from dataclasses import dataclass, replace

import torch

from mlaserve.kernels.mla_decode import tuning
from mlaserve.kernels.mla_decode.common import (
    GLUON_FP8_TRANSPOSED_TILE,
    GLUON_SM90,
    GLUON_SM90_FP8,
    GLUON_SM90_FP8_T,
    MAX_MERGE_CHUNK,
    TRITON_SPLIT,
    gluon_fp8_serves,
    gluon_fp8_transposed_serves,
    gluon_serves,
    next_pow2,
    whole_tiles,
)

SPLIT_POLICIES = ("waves", "fill")


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch configuration of the decode kernels; `default_config` picks one from the shape.

    Attributes:
        block_m: query rows (q_len * heads, folded) per program: the head-group size. A power of
            two >= 16; rows past M are masked.
        block_n: KV tokens per tile, a power of two >= 16.
        num_warps: warps per stage-1 program.
        num_stages: software-pipelining depth of the KV loop.
        split_policy: how `plan_mla_decode` picks the split count. "waves": minimise the
            estimated makespan (waves of programs times tokens per split plus a per-split
            overhead); "fill": just enough splits to put `programs_per_sm` programs on every SM.
            Either gives S, the split count of a uniform batch at the host-side length bound.
        balanced_splits: the split length planned on the device once a step from the actual
            lengths (`split_plan.py`), within a grid of splits that bounds it: short batches
            are not cut for the bound's length, and a ragged batch's long requests take more
            splits than its short ones (every split pass).
        programs_per_sm: programs that run at once on one SM (for "waves"), or the target grid
            size per SM (for "fill").
        min_split_len: fewest KV tokens per split; also enforced on the device, so short requests
            in a batch planned for long ones use few splits.
        max_num_splits: upper bound on the split count (bounds the workspace).
        merge_block_rows: output rows per merge program.
        merge_num_warps: warps per merge program.
        programmatic_launch: on sm_90 and newer, launch the merge kernel as a programmatic
            dependent of the split pass, so its launch overlaps the split pass's tail.
        tma_loads: on sm_90 and newer, load whole KV tiles with TMA (tensor descriptors over
            the cache) where a tile lies inside one page; the partial last tile of a split
            always uses masked loads.
        warp_specialized: on sm_90 with L = 512, R >= 64, 16-bit data, 64-row programs and
            32-token tiles within a page in an even ring (num_stages), run the split pass as the
            warp-specialised Gluon kernel of `gluon_sm90.py` (a TMA loader warp, two compute
            warpgroups in the seesaw schedule); num_warps does not apply. Over an FP8 cache
            only where fp8_stages > 0.
        fp8_stages: with warp_specialized over an FP8 cache, the FP8 tiles of the Gluon
            kernel's staging ring, which its converter warps turn into the 16-bit ring
            (num_stages, which may then be odd) the compute warpgroups read; 0: FP8 caches
            go to the Triton split pass.
        partial_dtype: element type of the split pass's partial outputs: "float32", or
            "input" (q's dtype when 16-bit).
        gluon_fp8: on sm_90 with a 16-bit q over an FP8 cache, at most 16 query rows,
            L = 512, R = 64 and tiles within a page, run the split pass as the Gluon kernel of
            `gluon_sm90_fp8.py` (each FP8 tile converted once into a float16 shared tile that
            both products read), block_n tokens a tile and num_stages FP8 tiles in its ring;
            num_warps does not apply.
        fp8_transposed: with gluon_fp8, run instead the Gluon kernel of
            `gluon_sm90_fp8_transposed.py` (both products transposed so that the query rows
            are wgmma's N, each FP8 tile converted in registers; 64-key tiles, so pages of a
            multiple of 64 tokens), num_stages FP8 tiles in its ring; only with block_n 64.
        latent_chunks: the Triton split pass holds the latent (L columns of q, of each KV
            tile and of the accumulator) as this many column chunks, each its own dot, so no
            operand of a whole [block_n, L] tile has to live in registers at once; a power of
            two with L / latent_chunks >= 16.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_policy: str = "waves"
    balanced_splits: bool = False
    programs_per_sm: float = 1.0
    min_split_len: int = 128
    max_num_splits: int = 128
    merge_block_rows: int = 4
    merge_num_warps: int = 4
    programmatic_launch: bool = True
    tma_loads: bool = False
    warp_specialized: bool = False
    partial_dtype: str = "float32"
    latent_chunks: int = 1
    gluon_fp8: bool = False
    fp8_transposed: bool = False
    fp8_stages: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_policy not in SPLIT_POLICIES:
            raise ValueError(f"split_policy must be one of {SPLIT_POLICIES}, "
                             f"got {self.split_policy!r}")
        if self.partial_dtype not in ("float32", "input"):
            raise ValueError(
                f"partial_dtype must be 'float32' or 'input', got {self.partial_dtype!r}")
        if self.merge_block_rows < 1 or self.merge_block_rows & (self.merge_block_rows - 1):
            raise ValueError(
                f"merge_block_rows must be a power of two, got {self.merge_block_rows}")
        if self.latent_chunks < 1 or self.latent_chunks & (self.latent_chunks - 1):
            raise ValueError(
                f"latent_chunks must be a power of two, got {self.latent_chunks}")
        if self.fp8_stages < 0:
            raise ValueError(f"fp8_stages must be >= 0, got {self.fp8_stages}")


@dataclass(frozen=True)
class MLADecodePlan:
    """What one decode step launches; built by `plan_mla_decode` from host-side ints only.

    Attributes:
        kernel: the split pass that runs: `TRITON_SPLIT`, `GLUON_SM90`, `GLUON_SM90_FP8` or
            `GLUON_SM90_FP8_T` (common.py).
        tma_loads: the Triton split pass loads whole tiles by TMA (sm_90+, a 16-bit or FP8
            cache, tiles within a page, asked for by the config); the cache's pages must lie
            back to back.
        programmatic_launch: the merge kernel is a programmatic dependent launch (sm_90+,
            more than one split, asked for by the config).
        num_splits: KV splits per request (1: no merge kernel, no workspace).
        num_head_groups: stage-1 programs per (request, split), ceil(q_len * H / block_m).
        config: the launch configuration (its `min_split_len` rounded up to whole tiles).
        workspace_o_numel: float32 elements of the partial-output workspace (0 with one split;
            half the partial outputs' count when they are 16-bit, viewed in their dtype).
        workspace_lse_numel: float32 elements of the partial-LSE workspace (0 with one split).
        page_chunk: page ids the split pass reads at once (`page_chunk`).
        split_slots: with `config.balanced_splits`, the programs that run at once in the
            device's split plan (`split_plan.py`; 0: no split plan on the device, the split
            length comes from num_splits alone).
        split_overhead: a split's cost in keys, for the device's split plan.
        fp16_dots: the split pass runs its dots in float16 (q converted once per program): a
            bfloat16 q over an FP8 cache, whose tiles convert to float16 in one instruction per
            two elements, against three per element for bfloat16 (through float16 and
            float32); benchmarks/mla-decode-history.md ("FP8 caches") has the timings. The
            FP8 values convert exactly; q is rounded to float16, whose range (+-65504) is
            narrower than bfloat16's: a larger query element would overflow. The FP8 Gluon
            passes do the same.
        merge_block_rows, merge_block_l, merge_split_chunk: the merge kernel's tile
            (`merge_tile`).
        fp8_staging: `GLUON_SM90` over an FP8 cache: the FP8 tiles of its staging ring
            (`config.fp8_stages`); 0 over a 16-bit cache and for every other kernel.

    Every compile-time parameter of the launch comes from here, so two launches with equal plans
    run one compiled kernel: an eager step planned like a captured CUDA graph compiles nothing.
    """

    kernel: str
    tma_loads: bool
    programmatic_launch: bool
    num_splits: int
    num_head_groups: int
    config: MLADecodeConfig
    workspace_o_numel: int
    workspace_lse_numel: int
    page_chunk: int
    merge_block_rows: int
    merge_block_l: int
    merge_split_chunk: int
    fp16_dots: bool = False
    split_slots: int = 0
    split_overhead: int = 0
    fp8_staging: int = 0


def default_config(
    num_heads: int,
    q_len: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    dtype: torch.dtype,
    batch_size: int | None = None,
    max_seq_len: int | None = None,
    block_size: int | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> MLADecodeConfig:
    """A launch configuration for the shape from the tuned table (`tuning.py`); batch_size,
    max_seq_len, block_size and kv_cache_dtype (None: dtype's cache) refine it when given.

    - More than 16 query rows with 16-bit data, L = 512, 64 <= R <= 256 and pages of 32 or more
      tokens: the Gluon sm_90 pass's configuration (`tuning.GLUON_SM90_CONFIG`); the plan runs
      the Triton kernel with the same tile where the Gluon pass cannot (off sm_90). Rows are
      padded to 64. Over an FP8 cache, the same pass with FP8 tiles staged and a ring of
      converted tiles instead (`tuning.FP8_CACHE_WIDE_ROWS_CONFIG`).
    - Otherwise query rows per program (block_m): all rows up to 64; at >= 64 heads small
      batches (< 8 requests) use 32-row groups instead, for more programs on the SMs.
    - KV tile and pipelining depth per regime (`tuning.TRITON_TILES`): pages under 32 tokens
      take tiles of whole pages (32 tokens; 64 under the "fill" policy), pages of 32-63 tokens
      one page per tile; 16 rows over 32-255 short requests one 64-token program per SM;
      16 rows over >= 32 requests, or 64-token tiles that do not fit, 32-token tiles; else
      64-token tiles with 2 stages. 64-row Triton programs load whole tiles by TMA.
    - Partial outputs: 16-bit for 16-row programs over 32-255 requests, else float32.
    - An FP8 cache under 16-row programs: the transposed FP8 Gluon pass (`fp8_transposed`)
      with `tuning.GLUON_FP8_TRANSPOSED_STAGES` where that is set and the pages are whole
      64-key tiles; else the FP8 Gluon pass (`gluon_fp8`) with its tile
      `tuning.GLUON_FP8_TILE` where that is set and the pages hold a tile (None: the Triton
      pass with the tiles above).
    - float32 inputs (tests only) use 16-row groups and tiles sized for the interpreter.
    """
    head_dim = kv_lora_rank + qk_rope_head_dim
    itemsize = dtype.itemsize
    rows = q_len * num_heads
    merge_block_rows = max(1, min(next_pow2(rows), tuning.MERGE_ROW_ELEMENTS // kv_lora_rank))
    long_requests = max_seq_len is not None and max_seq_len > tuning.LONG_REQUEST_TOKENS
    if itemsize > 2:  # float32: tests under the interpreter and FMA dots on a GPU
        block_m = tuning.FLOAT32_BLOCK_M
        q_bytes = block_m * head_dim * itemsize
        block_n = next((n for n in tuning.FLOAT32_BLOCK_NS
                        if q_bytes + 2 * n * head_dim * itemsize <= tuning.FLOAT32_SMEM_BUDGET),
                       tuning.FLOAT32_BLOCK_NS[-1])
        return MLADecodeConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2,
                               min_split_len=max(2 * block_n, tuning.FLOAT32_MIN_SPLIT_LEN),
                               merge_block_rows=merge_block_rows)
    fp8_cache = kv_cache_dtype is not None and kv_cache_dtype.itemsize == 1
    if (rows > 16 and kv_lora_rank == 512 and 64 <= qk_rope_head_dim <= 256
            and (block_size is None or block_size >= tuning.GLUON_MIN_PAGE)):
        wide = tuning.FP8_CACHE_WIDE_ROWS_CONFIG if fp8_cache else tuning.GLUON_SM90_CONFIG
        return MLADecodeConfig(**wide, merge_block_rows=merge_block_rows)
    block_m = min(max(16, next_pow2(rows)), 64)
    wide_heads, small_batch = tuning.SMALL_BATCH_WIDE_HEADS
    if (block_m == 64 and num_heads >= wide_heads and batch_size is not None
            and batch_size < small_batch):
        block_m = 32
    q_bytes = block_m * head_dim * itemsize
    fits_64 = q_bytes + 2 * 64 * head_dim * itemsize <= tuning.TRITON_SMEM_BUDGET
    low, high = tuning.MEDIUM_BATCH
    medium_batch = batch_size is not None and low <= batch_size < high
    short_requests = max_seq_len is not None and max_seq_len <= tuning.SHORT_REQUEST_TOKENS
    one_per_sm = block_m == 16 and medium_batch and short_requests and (
        block_size is None or block_size >= 64)
    if block_size is not None and block_size < 32:
        regime = "gathered_pages"
    elif block_size is not None and block_size < 64:
        regime = "small_pages"
    elif one_per_sm:
        regime = "one_per_sm"
    elif block_m == 16 and batch_size is not None and batch_size >= low or not fits_64:
        regime = "many_requests"
    else:
        regime = "default"
    block_n, num_stages = tuning.TRITON_TILES[regime]
    if regime == "small_pages":
        block_n = max(16, block_size)
    num_warps = 8 if (block_m >= 64 or one_per_sm) and kv_lora_rank >= 256 else 4
    policy, per_sm = "waves", (2.0 if block_m <= 32 and not one_per_sm else 1.0)
    if (block_m == 16 and batch_size is not None and long_requests
            and batch_size >= tuning.FILL_MIN_BATCH):
        policy, per_sm = "fill", tuning.FILL_PROGRAMS_PER_SM
        if regime == "gathered_pages":
            block_n, num_stages = tuning.TRITON_TILES["gathered_pages_fill"]
    fp8_cache_16_rows = fp8_cache and block_m == 16
    transposed_stages = tuning.GLUON_FP8_TRANSPOSED_STAGES
    fp8_transposed = (fp8_cache_16_rows and transposed_stages is not None
                      and (block_size is None or block_size % GLUON_FP8_TRANSPOSED_TILE == 0))
    fp8_tile = tuning.GLUON_FP8_TILE
    gluon_fp8 = fp8_transposed or (fp8_cache_16_rows and fp8_tile is not None
                                   and (block_size is None or block_size >= fp8_tile[0]))
    if fp8_transposed:
        block_n, num_stages = GLUON_FP8_TRANSPOSED_TILE, transposed_stages
        per_sm = tuning.GLUON_FP8_TRANSPOSED_PROGRAMS_PER_SM
    elif gluon_fp8:
        block_n, num_stages = fp8_tile
    min_split_len = tuning.MIN_SPLIT_LEN[(block_m, long_requests)]
    partial_dtype = "input" if block_m == 16 and medium_batch else "float32"
    return MLADecodeConfig(block_m=block_m, block_n=block_n, num_warps=num_warps,
                           num_stages=num_stages, split_policy=policy, programs_per_sm=per_sm,
                           min_split_len=min_split_len, merge_block_rows=merge_block_rows,
                           tma_loads=block_m >= 64, partial_dtype=partial_dtype,
                           gluon_fp8=gluon_fp8, fp8_transposed=fp8_transposed)


def _choose_num_splits(
    base_programs: int,
    max_seq_len: int,
    config: MLADecodeConfig,
    num_sms: int,
    split_overhead_tokens: int,
) -> int:
    max_by_length = max(1, min(config.max_num_splits, -(-max_seq_len // config.min_split_len)))
    slots = max(1, round(num_sms * config.programs_per_sm))
    if config.split_policy == "fill":
        return max(1, min(max_by_length, -(-slots // base_programs)))

    def makespan(splits: int) -> int:
        waves = -(-(base_programs * splits) // slots)
        per_split = -(-max_seq_len // splits) + (split_overhead_tokens if splits > 1 else 0)
        merge_rounds = -(-splits // MAX_MERGE_CHUNK)  # dependent load rounds of the merge
        return waves * per_split + (merge_rounds - 1) * split_overhead_tokens

    return min(range(1, max_by_length + 1), key=lambda splits: (makespan(splits), splits))


def plan_mla_decode(
    batch_size: int,
    max_seq_len: int,
    num_heads: int,
    q_len: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    dtype: torch.dtype,
    num_sms: int,
    block_size: int,
    config: MLADecodeConfig | None = None,
    num_splits: int | None = None,
    capability: tuple[int, int] | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> MLADecodePlan:
    """Choose the kernel, its configuration, the split count and the workspace sizes for one
    decode step; host-side ints only.

    Args:
        batch_size: B, requests in the step.
        max_seq_len: an upper bound on the KV lengths (e.g. block_table.shape[1] * block_size);
            a loose bound costs only empty splits, never correctness.
        num_heads: H.
        q_len: new tokens per request.
        kv_lora_rank: L.
        qk_rope_head_dim: R.
        dtype: q's dtype (and the cache's unless kv_cache_dtype is given).
        num_sms: streaming multiprocessors on the device.
        block_size: tokens per KV page.
        config: launch configuration; `default_config` of the shape when None.
        num_splits: force this split count (any value >= 1 is valid for any lengths), e.g. to keep
            one count for a captured CUDA graph.
        capability: the CUDA device's (major, minor) compute capability (`device_capability`);
            None off CUDA (the Triton interpreter).
        kv_cache_dtype: the cache's dtype (None: q's); torch.float8_e4m3fn is an FP8
            cache, read by the Triton split pass (by TMA where the config asks; converted
            to q's dtype, float16 for a bfloat16 q: `fp16_dots`) or, where the config asks
            (`gluon_fp8`), by the FP8 Gluon pass, or (`fp8_stages` with `warp_specialized`)
            by the 64-row Gluon pass with its FP8 tiles staged and converted.

    Returns:
        The plan to pass to `mla_decode_triton`.
    """
    cache_dtype = kv_cache_dtype or dtype
    fp8_cache = cache_dtype.itemsize == 1
    if config is None:
        config = default_config(num_heads, q_len, kv_lora_rank, qk_rope_head_dim, dtype,
                                batch_size, max_seq_len, block_size, kv_cache_dtype)
    config = replace(config, min_split_len=whole_tiles(config.min_split_len, config.block_n))
    if kv_lora_rank % config.latent_chunks or kv_lora_rank // config.latent_chunks < 16:
        raise ValueError(f"latent_chunks {config.latent_chunks} must leave chunks of at least "
                         f"16 of the {kv_lora_rank} latent columns")
    rows = q_len * num_heads
    num_head_groups = -(-rows // config.block_m)
    balanced = config.balanced_splits
    head_dim = kv_lora_rank + qk_rope_head_dim
    # A split costs a launch slot plus writing and re-reading a float32 [block_m, L] partial
    # output: count that in KV tokens of the same number of bytes.
    overhead = 32 + (2 * 4 * config.block_m * kv_lora_rank) // (head_dim * cache_dtype.itemsize)
    slots = max(1, round(num_sms * config.programs_per_sm))
    uniform_splits = num_splits
    if num_splits is None:
        base_programs = max(1, batch_size * num_head_groups)
        uniform_splits = num_splits = _choose_num_splits(base_programs, max(1, max_seq_len),
                                                         config, num_sms, overhead)
        if balanced:  # a grid that bounds the splits the device plans
            most = max(1, min(config.max_num_splits, -(-max_seq_len // config.min_split_len)))
            wanted = -(-tuning.BALANCED_GRID_PROGRAMS_PER_SLOT * slots // base_programs)
            num_splits = min(most, max(num_splits, wanted))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split_slots = slots if balanced and num_splits > 1 else 0
    o_numel = batch_size * num_splits * rows * kv_lora_rank if num_splits > 1 else 0
    if partial_dtype_of(config, dtype) != torch.float32:
        o_numel = -(-o_numel // 2)  # 16-bit partials: float32 storage viewed as q's dtype
    lse_numel = batch_size * num_splits * rows if num_splits > 1 else 0
    merge_rows, merge_l, merge_chunk = merge_tile(config, batch_size, rows, num_splits,
                                                  kv_lora_rank)
    kernel = TRITON_SPLIT
    fp8_staging = config.fp8_stages if fp8_cache else 0
    gluon = config.warp_specialized and gluon_serves(
        capability, dtype, kv_lora_rank, qk_rope_head_dim, config.block_m, config.block_n,
        config.num_stages, block_size, fp8_staging)
    if gluon and (fp8_staging or not fp8_cache):
        kernel = GLUON_SM90
    elif config.gluon_fp8 and config.fp8_transposed and (
            gluon_fp8_transposed_serves(capability, dtype, cache_dtype, rows, kv_lora_rank,
                                        qk_rope_head_dim, config.block_n, config.num_stages,
                                        block_size)):
        kernel = GLUON_SM90_FP8_T
    elif config.gluon_fp8 and gluon_fp8_serves(
            capability, dtype, cache_dtype, rows, kv_lora_rank, qk_rope_head_dim,
            config.block_n, config.num_stages, block_size):
        kernel = GLUON_SM90_FP8
    sm90_or_newer = capability is not None and capability >= (9, 0)
    tma_loads = (kernel == TRITON_SPLIT and config.tma_loads and sm90_or_newer
                 and cache_dtype.itemsize <= 2 and block_size >= config.block_n)
    programmatic_launch = num_splits > 1 and config.programmatic_launch and sm90_or_newer
    return MLADecodePlan(kernel=kernel, tma_loads=tma_loads,
                         programmatic_launch=programmatic_launch,
                         num_splits=num_splits, num_head_groups=num_head_groups, config=config,
                         workspace_o_numel=o_numel, workspace_lse_numel=lse_numel,
                         page_chunk=page_chunk(config, max_seq_len, uniform_splits),
                         merge_block_rows=merge_rows, merge_block_l=merge_l,
                         merge_split_chunk=merge_chunk,
                         fp16_dots=fp8_cache and dtype == torch.bfloat16,
                         split_slots=split_slots, split_overhead=overhead if split_slots else 0,
                         fp8_staging=fp8_staging if kernel == GLUON_SM90 else 0)


def partial_dtype_of(config: MLADecodeConfig, dtype: torch.dtype) -> torch.dtype:
    """The element type of the partial outputs for inputs of `dtype` under `config`."""
    if config.partial_dtype == "input" and dtype.itemsize == 2:
        return dtype
    return torch.float32


def merge_tile(config: MLADecodeConfig, batch_size: int, num_rows: int, num_splits: int,
               kv_lora_rank: int) -> tuple[int, int, int]:
    """(rows per merge program, columns per program, splits per load) for the merge kernel.

    Splits per load: all of them up to 64 (rounded up to a power of two). Columns: L, halved
    (down to 32, at most 8 pieces) while the batch has fewer than 256 output rows, so a small
    batch's merge still spreads over many SMs. Rows: the config's `merge_block_rows`, fewer when
    a chunk of [splits, rows, columns] float32 would pass 8192 elements (32 KB of registers).
    """
    split_chunk = min(next_pow2(num_splits), MAX_MERGE_CHUNK)
    pieces = 1
    while (pieces < 8 and kv_lora_rank // (2 * pieces) >= 32
           and batch_size * num_rows * pieces < 256):
        pieces *= 2
    block_l = kv_lora_rank // pieces
    block_rows = min(config.merge_block_rows, next_pow2(num_rows),
                     max(1, 8192 // (split_chunk * block_l)))
    return block_rows, block_l, split_chunk


def page_chunk(config: MLADecodeConfig, max_seq_len: int, num_splits: int) -> int:
    """Page ids the split pass reads at once: the tiles of the longest possible split (from the
    host-side bound on the lengths), as a power of two from 1 to 64; longer splits read them 64
    tiles at a time. 0 (page ids read in the tile loop) for 64-row programs: wgmma programs keep
    num_stages KV buffers either way, and the page vector cost the 128-head program a register
    spill (benchmarks/mla-decode-history.md)."""
    if config.block_m >= 64:
        return 0
    split_len = max(-(-max_seq_len // max(num_splits, 1)), config.min_split_len, 1)
    return min(next_pow2(-(-split_len // config.block_n)), 64)


def alloc_workspace(plan: MLADecodePlan, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial-output and partial-LSE buffers a plan needs (float32, flat; may be empty).

    Returns:
        partial_o [workspace_o_numel] float32 and partial_lse [workspace_lse_numel] float32; a
        larger buffer is fine (the front is used), so one allocation can serve many plans.
    """
    return (torch.empty(plan.workspace_o_numel, dtype=torch.float32, device=device),
            torch.empty(plan.workspace_lse_numel, dtype=torch.float32, device=device))


def describe(plan: MLADecodePlan) -> str:
    """The kernel and configuration a plan runs, in one line (what `bench kernel` prints)."""
    c = plan.config
    parts = [plan.kernel, f"m{c.block_m} n{c.block_n}"]
    if plan.kernel == TRITON_SPLIT:
        parts.append(f"w{c.num_warps}")
    parts.append(f"s{c.num_stages}")
    if plan.fp8_staging:
        parts.append(f"fp8-s{plan.fp8_staging}")
    parts.append(f"splits {plan.num_splits}")
    if c.latent_chunks > 1 and plan.kernel == TRITON_SPLIT:
        parts.append(f"latent/{c.latent_chunks}")
    if plan.num_splits > 1:
        balance = f" balanced {plan.split_slots} slots" if plan.split_slots else ""
        parts.append(f"({c.split_policy}{balance} {c.programs_per_sm:g}/SM, "
                     f"min {c.min_split_len}, {c.partial_dtype} partials)")
    flags = [name for name, on in (("tma", plan.tma_loads), ("pdl", plan.programmatic_launch),
                                   ("fp16-dots", plan.fp16_dots and plan.kernel == TRITON_SPLIT))
             if on]
    return " ".join(parts + flags)
