"""Host-side planning of the Triton paged MLA decode (`mla_decode.py`): launch configurations
tuned on an H200, the split count per step, and workspace sizes.

Everything here is Python ints and dataclasses (batch size, an upper bound on the KV length, SM
count), so planning a step never synchronises with the device, and needs no Triton.
"""

from dataclasses import dataclass, replace

import torch

# Most splits the merge kernel reads in one load (more take further rounds of loads).
MAX_MERGE_CHUNK = 64


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
        programs_per_sm: programs that run at once on one SM (for "waves"), or the target grid
            size per SM (for "fill").
        min_split_len: fewest KV tokens per split; also enforced on the device, so short requests
            in a batch planned for long ones use few splits.
        max_num_splits: upper bound on the split count (bounds the workspace).
        merge_block_rows: output rows per merge program.
        merge_num_warps: warps per merge program.
        programmatic_launch: on sm_90 and newer, launch the merge kernel as a programmatic
            dependent of the split pass, so its launch overlaps the split pass's tail (0.6-0.9
            µs at batch 1 on the H200: 9.8 -> 9.1 at kv 1024, 15.2 -> 14.3 at 8192).
        tma_loads: on sm_90 and newer, load whole KV tiles with TMA (tensor descriptors over
            the cache) where a tile lies inside one page; the partial last tile of a split
            always uses masked loads.
        warp_specialized: on sm_90 with L = 512, R >= 64, 16-bit data, 64-row programs and
            32-token tiles within a page in an even ring (num_stages), run the split pass as the
            warp-specialised Gluon kernel of `mla_decode_sm90.py` (a TMA loader warp, two
            compute warpgroups in the seesaw schedule); num_warps does not apply.
        partial_dtype: element type of the split pass's partial outputs: "float32", or
            "input" (q's dtype when 16-bit).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_policy: str = "waves"
    programs_per_sm: float = 1.0
    min_split_len: int = 128
    max_num_splits: int = 128
    merge_block_rows: int = 4
    merge_num_warps: int = 4
    programmatic_launch: bool = True
    tma_loads: bool = False
    warp_specialized: bool = False
    partial_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_policy not in ("waves", "fill"):
            raise ValueError(f"split_policy must be 'waves' or 'fill', got {self.split_policy!r}")
        if self.partial_dtype not in ("float32", "input"):
            raise ValueError(
                f"partial_dtype must be 'float32' or 'input', got {self.partial_dtype!r}")
        if self.merge_block_rows < 1 or self.merge_block_rows & (self.merge_block_rows - 1):
            raise ValueError(
                f"merge_block_rows must be a power of two, got {self.merge_block_rows}")


@dataclass(frozen=True)
class MLADecodePlan:
    """What one decode step launches; built by `plan_mla_decode` from host-side ints only.

    Attributes:
        num_splits: KV splits per request (1: no merge kernel, no workspace).
        num_head_groups: stage-1 programs per (request, split), ceil(q_len * H / block_m).
        config: the launch configuration (its `min_split_len` rounded up to whole tiles).
        workspace_o_numel: float32 elements of the partial-output workspace (0 with one split;
            half the partial outputs' count when they are 16-bit, viewed in their dtype).
        workspace_lse_numel: float32 elements of the partial-LSE workspace (0 with one split).
        page_chunk: page ids the split pass reads at once (`page_chunk`).
        merge_block_rows, merge_block_l, merge_split_chunk: the merge kernel's tile
            (`merge_tile`).

    Every compile-time parameter of the launch comes from here, so two launches with equal plans
    run one compiled kernel: an eager step planned like a captured CUDA graph compiles nothing.
    """

    num_splits: int
    num_head_groups: int
    config: MLADecodeConfig
    workspace_o_numel: int
    workspace_lse_numel: int
    page_chunk: int
    merge_block_rows: int
    merge_block_l: int
    merge_split_chunk: int


def next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def default_config(
    num_heads: int,
    q_len: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    dtype: torch.dtype,
    batch_size: int | None = None,
    max_seq_len: int | None = None,
    block_size: int | None = None,
) -> MLADecodeConfig:
    """A launch configuration for the shape, from the H200 sweep (`scripts/gpu_kernel_sweep.py`,
    results in benchmarks/); batch_size and max_seq_len refine it when given.

    - More than 16 query rows with 16-bit data, L = 512, 64 <= R <= 256 and pages of 32 or more
      tokens: 64-row programs of the seesaw Gluon pass on sm_90 (`mla_decode_sm90.py`,
      benchmarks/2026-12-02-h200-mla-decode-seesaw/), 32-token tiles x 4 buffers, one program
      per SM, at most 32 splits of 64 or more tokens. On the H200: 147.7 / 48.9 / 359.5 µs at
      128 heads x batch 64 x 4096 / 64 x 1024 / 512 x 1024, against 165.8 / 54.7 / 376.1 for
      the earlier pass with both warpgroups on one tile, and 142.6 / 43.1 / 328.5 with the
      output stored by TMA (benchmarks/2026-12-03-h200-mla-decode-tma-store/); 17.1 / 20.6 µs
      at 128 heads x batch 1 x 4096 / 8192 against 23.0 / 25.3 for 32-row Triton programs (33
      splits; 66 took 20.8 / 23.3). Rows are padded to 64: 84.0 against 97.2 µs for 32-row
      Triton programs at 16 heads x q_len 2 x 64 x 4096 (2 splits). Off sm_90 the Triton kernel
      runs the same tile.
    - Otherwise, query rows per program (block_m): all rows up to 64; at 128 heads small
      batches (< 8 requests) use 32-row groups instead, for more programs on the SMs.
    - KV tile and pipelining depth, from `scripts/gpu_variant_sweep.py` on the H200
      (benchmarks/2026-12-02-h200-mla-decode-pipelined/). Triton's pipeliner gives a 16- or 32-row
      program (mma.sync) num_stages - 1 KV buffers and a 64-row program (wgmma) num_stages.
      16 rows over 32 or more requests: 32-token tiles with 3 stages (two buffers, two programs
      per SM): 31.8 / 85.2 / 168.2 / 602.7 µs at batch 64 x 1k / 64 x 4k / 512 x 1k / 512 x 4k
      against 34.1 / 85.5 / 168.5 / 614.2 with 64-token tiles and 2 stages, which stay for
      small batches. Over 32-255 requests of at most 1024 tokens, 64-token tiles x 2 buffers
      with 8 warps, one program per SM (166 KB): 28.9 / 45.0 / 83.8 µs at batch 64 / 128 / 200
      x 1024 against 29.2 / 47.4 / 86.1, 19.5 against 19.5 at 32 x 1024, but 47.3 against 46.6
      at 64 x 2048 (benchmarks/2026-12-03-h200-mla-decode-tma-store/). Pages of 32 tokens
      take 32-token tiles with 3 stages (606.5 µs at 16 heads x 512 x 4096, against 823.6 with
      4 stages: one program per SM). Otherwise 64-token tiles with 2 stages where they fit
      (~220 KB at 64 rows x 576), else 32-token tiles, 3 stages; 64-row Triton programs load
      whole tiles by TMA (7-9% at 128 heads) and aim at one program per SM.
    - Partial outputs: 16-bit for 16-row programs over 32-255 requests, else float32.
    - float32 inputs (tests only) use 16-row groups and 16-token tiles sized for the interpreter.
    """
    head_dim = kv_lora_rank + qk_rope_head_dim
    itemsize = dtype.itemsize
    rows = q_len * num_heads
    merge_block_rows = max(1, min(next_pow2(rows), 2048 // kv_lora_rank))
    long_requests = max_seq_len is not None and max_seq_len > 2048
    if itemsize > 2:  # float32: tests under the interpreter and FMA dots on a GPU
        block_m = 16
        smem_budget = 180 * 1024
        q_bytes = block_m * head_dim * itemsize
        block_n = next((n for n in (64, 32, 16)
                        if q_bytes + 2 * n * head_dim * itemsize <= smem_budget), 16)
        return MLADecodeConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=2,
                               min_split_len=max(2 * block_n, 64),
                               merge_block_rows=merge_block_rows)
    if (rows > 16 and kv_lora_rank == 512 and 64 <= qk_rope_head_dim <= 256
            and (block_size is None or block_size >= 32)):
        return MLADecodeConfig(block_m=64, block_n=32, num_warps=8, num_stages=4,
                               programs_per_sm=1.0, min_split_len=64, max_num_splits=32,
                               merge_block_rows=merge_block_rows,
                               tma_loads=True, warp_specialized=True)
    block_m = min(max(16, next_pow2(rows)), 64)
    if block_m == 64 and num_heads >= 64 and batch_size is not None and batch_size < 8:
        block_m = 32
    q_bytes = block_m * head_dim * itemsize
    fits_64 = q_bytes + 2 * 64 * head_dim * itemsize <= 224 * 1024
    medium_batch = batch_size is not None and 32 <= batch_size < 256
    short_requests = max_seq_len is not None and max_seq_len <= 1024
    one_per_sm = block_m == 16 and medium_batch and short_requests and (
        block_size is None or block_size >= 64)
    if block_size is not None and block_size < 64:
        block_n, num_stages = max(16, block_size), 3
    elif one_per_sm:
        block_n, num_stages = 64, 3
    elif block_m == 16 and batch_size is not None and batch_size >= 32 or not fits_64:
        block_n, num_stages = 32, 3
    else:
        block_n, num_stages = 64, 2
    num_warps = 8 if (block_m >= 64 or one_per_sm) and kv_lora_rank >= 256 else 4
    policy, per_sm = "waves", (2.0 if block_m <= 32 and not one_per_sm else 1.0)
    if (block_m == 16 and batch_size is not None and long_requests
            and batch_size >= 264):
        policy, per_sm = "fill", 4.0
    if block_m == 16:
        min_split_len = 128 if long_requests else 64
    else:
        min_split_len = 256 if block_m == 64 or long_requests else 64
    # 16-bit partials at 16 rows x 32-255 requests (benchmarks/2026-12-02-h200-mla-decode-16-heads,
    # section 4): 29.1 / 80.1 µs against 33.2 / 83.3 for float32 at batch 64 x 1024 / 4096
    # (4 splits); float32 stays at 512 x 4096 (613.7 against 630.8 µs, 2 splits).
    partial_dtype = "input" if block_m == 16 and medium_batch else "float32"
    return MLADecodeConfig(block_m=block_m, block_n=block_n, num_warps=num_warps,
                           num_stages=num_stages, split_policy=policy, programs_per_sm=per_sm,
                           min_split_len=min_split_len, merge_block_rows=merge_block_rows,
                           tma_loads=block_m >= 64, partial_dtype=partial_dtype)


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
    config: MLADecodeConfig | None = None,
    num_splits: int | None = None,
    block_size: int | None = None,
) -> MLADecodePlan:
    """Choose the split count and workspace sizes for one decode step; host-side ints only.

    Args:
        batch_size: B, requests in the step.
        max_seq_len: an upper bound on the KV lengths (e.g. block_table.shape[1] * block_size);
            a loose bound costs only empty splits, never correctness.
        num_heads: H.
        q_len: new tokens per request.
        kv_lora_rank: L.
        qk_rope_head_dim: R.
        dtype: q and cache dtype.
        num_sms: streaming multiprocessors on the device.
        config: launch configuration; `default_config` of the shape when None.
        num_splits: force this split count (any value >= 1 is valid for any lengths), e.g. to keep
            one count for a captured CUDA graph.
        block_size: tokens per KV page (refines the default configuration).

    Returns:
        The plan to pass to `mla_decode_triton`.
    """
    if config is None:
        config = default_config(num_heads, q_len, kv_lora_rank, qk_rope_head_dim, dtype,
                                batch_size, max_seq_len, block_size)
    min_split_len = -(-max(config.min_split_len, 1) // config.block_n) * config.block_n
    config = replace(config, min_split_len=min_split_len)
    rows = q_len * num_heads
    num_head_groups = -(-rows // config.block_m)
    if num_splits is None:
        head_dim = kv_lora_rank + qk_rope_head_dim
        itemsize = dtype.itemsize
        # A split costs a launch slot plus writing and re-reading a float32 [block_m, L] partial
        # output: count that in KV tokens of the same number of bytes.
        overhead = 32 + (2 * 4 * config.block_m * kv_lora_rank) // (head_dim * itemsize)
        num_splits = _choose_num_splits(max(1, batch_size * num_head_groups), max(1, max_seq_len),
                                        config, num_sms, overhead)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    o_numel = batch_size * num_splits * rows * kv_lora_rank if num_splits > 1 else 0
    if partial_dtype_of(config, dtype) != torch.float32:
        o_numel = -(-o_numel // 2)  # 16-bit partials: float32 storage viewed as q's dtype
    lse_numel = batch_size * num_splits * rows if num_splits > 1 else 0
    merge_rows, merge_l, merge_chunk = merge_tile(config, batch_size, rows, num_splits,
                                                  kv_lora_rank)
    return MLADecodePlan(num_splits=num_splits, num_head_groups=num_head_groups, config=config,
                         workspace_o_numel=o_numel, workspace_lse_numel=lse_numel,
                         page_chunk=page_chunk(config, max_seq_len, num_splits),
                         merge_block_rows=merge_rows, merge_block_l=merge_l,
                         merge_split_chunk=merge_chunk)


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
    num_stages KV buffers either way, and the page vector cost the 128-head program a 128-byte
    register spill and 10% (scripts/kernel_resources.py, benchmarks/)."""
    if config.block_m >= 64:
        return 0
    split_len = max(-(-max_seq_len // max(num_splits, 1)), config.min_split_len, 1)
    return min(next_pow2(-(-split_len // config.block_n)), 64)


def alloc_workspace(plan: MLADecodePlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial-output and partial-LSE buffers a plan needs (float32, flat; may be empty).

    Returns:
        partial_o [workspace_o_numel] float32 and partial_lse [workspace_lse_numel] float32; a
        larger buffer is fine (the front is used), so one allocation can serve many plans.
    """
    return (torch.empty(plan.workspace_o_numel, dtype=torch.float32, device=device),
            torch.empty(plan.workspace_lse_numel, dtype=torch.float32, device=device))
