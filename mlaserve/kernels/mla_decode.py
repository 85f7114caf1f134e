"""Triton paged MLA decode: split-KV attention over the latent cache, then a log-sum-exp merge.

The problem (absorbed MLA decode, DESIGN §1 and §3). Per request b with KV length N_b and q_len new
tokens, the M = q_len * H query rows `[q_latent | q_pe]` (L + R wide) attend all cached rows
`[c_kv | k_pe]` of that request, causal among the new tokens; V is the first L columns of the same
cache rows. The output is o [B * q_len, H, L] in q's dtype and lse [B * q_len, H] (natural log,
float32).

Kernel design:
- Stage 1 (`_mla_decode_split_kernel`): one program per (head group, split, request). A head group
  is up to `block_m` of the request's M query rows (q_len folded into the rows, row r = t * H + h),
  so at <= 64 rows one program reads every KV tile exactly once for all heads and new tokens; wider
  requests use several programs with adjacent program ids (the head-group axis is grid axis 0), so
  the later reads of a tile hit L2. Each KV tile [block_n, L + R] is loaded once as two pieces,
  [block_n, L] and [block_n, R]: scores use two dots ([M, L] x [L, block_n] and [M, R] x [R,
  block_n]) and the [block_n, L] piece is reused as V for the third dot; online softmax in base 2,
  float32 accumulators.
- A split is a contiguous run of whole tiles of one request; its length is computed on the device
  from that request's length N_b, max(min_split_len, round_up(ceil(N_b / num_splits), block_n)),
  so any split count is valid for any lengths (splits past the end do no work and write
  lse = -inf). This is what lets a CUDA graph keep one fixed split count.
- Stage 2 (`_mla_decode_merge_kernel`): per output row, merge the splits' partial (o, lse) by
  log-sum-exp; empty splits are skipped without reading their partial output. With one split,
  stage 1 writes the final output directly and stage 2 is not launched.
- Pages: with block_size >= block_n a tile lies inside one page (one page id per tile); smaller
  pages are gathered row by row through the block table. Loads past the request's length are
  masked (other=0) and their scores set to -inf, so NaN in unused pages or in the tail of the last
  page never reaches the output.

Host-side planning (`plan_mla_decode`) uses only Python ints (batch size, an upper bound on the
KV length, SM count), so planning a step never synchronises with the device.
"""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


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

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_policy not in ("waves", "fill"):
            raise ValueError(f"split_policy must be 'waves' or 'fill', got {self.split_policy!r}")
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
        workspace_o_numel: float32 elements of the partial-output workspace (0 with one split).
        workspace_lse_numel: float32 elements of the partial-LSE workspace (0 with one split).
    """

    num_splits: int
    num_head_groups: int
    config: MLADecodeConfig
    workspace_o_numel: int
    workspace_lse_numel: int


def _next_pow2(value: int) -> int:
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

    - Query rows per program (block_m): all rows up to 64 with 16-bit inputs. At 128 heads
      small batches (< 8 requests) use 32-row groups instead, for more programs on the SMs.
    - KV tile: 64 tokens where Q plus two stages of [64, L + R] fit shared memory (~220 KB at
      64 rows x 576), else 32 tokens with a third stage (measured best for 64 rows of 16 heads).
      Pages of 32 tokens take 32-token tiles with 4 stages (one page per tile: 663 µs against
      925 µs for gathered 64-token tiles at 16 heads x 512 x 4096).
    - Splits: minimise the estimated makespan with two programs per SM counted as one wave for
      up to 32 rows; for 16 rows over large batches of long requests, fill four programs per SM
      (measured 10% faster at 512 x 4096). Longer requests take longer minimum splits (fewer
      partial outputs to merge).
    - float32 inputs (tests only) use 16-row groups and 16-token tiles sized for the interpreter.
    """
    head_dim = kv_lora_rank + qk_rope_head_dim
    itemsize = dtype.itemsize
    rows = q_len * num_heads
    long_requests = max_seq_len is not None and max_seq_len > 2048
    if itemsize > 2:  # float32: tests under the interpreter and FMA dots on a GPU
        block_m = 16
        smem_budget = 180 * 1024
        q_bytes = block_m * head_dim * itemsize
        block_n = next((n for n in (64, 32, 16)
                        if q_bytes + 2 * n * head_dim * itemsize <= smem_budget), 16)
        return MLADecodeConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=2,
                               min_split_len=max(2 * block_n, 64),
                               merge_block_rows=max(1, min(_next_pow2(rows), 2048 // kv_lora_rank)))
    block_m = min(max(16, _next_pow2(rows)), 64)
    if block_m == 64 and num_heads >= 64 and batch_size is not None and batch_size < 8:
        block_m = 32
    q_bytes = block_m * head_dim * itemsize
    fits_64 = q_bytes + 2 * 64 * head_dim * itemsize <= 224 * 1024
    if block_size is not None and block_size < 64:
        block_n, num_stages = max(16, block_size), 4 if block_m <= 16 else 3
    elif block_m == 64 and num_heads < 64 or not fits_64:
        block_n, num_stages = 32, 3
    else:
        block_n, num_stages = 64, 2
    num_warps = 8 if block_m >= 64 and kv_lora_rank >= 256 else 4
    policy, per_sm = "waves", (2.0 if block_m <= 32 else 1.0)
    if (block_m == 16 and batch_size is not None and long_requests
            and batch_size >= 264):
        policy, per_sm = "fill", 4.0
    if block_m == 16:
        min_split_len = 256 if long_requests else 128
    else:
        min_split_len = 256 if block_m == 64 or long_requests else 128
    merge_block_rows = max(1, min(_next_pow2(rows), 2048 // kv_lora_rank))
    return MLADecodeConfig(block_m=block_m, block_n=block_n, num_warps=num_warps,
                           num_stages=num_stages, split_policy=policy, programs_per_sm=per_sm,
                           min_split_len=min_split_len, merge_block_rows=merge_block_rows)


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
        return waves * (-(-max_seq_len // splits) + (split_overhead_tokens if splits > 1 else 0))

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
        The plan to pass (its `num_splits` and `config`) to `mla_decode_triton`.
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
    lse_numel = batch_size * num_splits * rows if num_splits > 1 else 0
    return MLADecodePlan(num_splits=num_splits, num_head_groups=num_head_groups, config=config,
                         workspace_o_numel=o_numel, workspace_lse_numel=lse_numel)


def alloc_workspace(plan: MLADecodePlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial-output and partial-LSE buffers a plan needs (float32, flat; may be empty).

    Returns:
        partial_o [workspace_o_numel] float32 and partial_lse [workspace_lse_numel] float32; a
        larger buffer is fine (the front is used), so one allocation can serve many plans.
    """
    return (torch.empty(plan.workspace_o_numel, dtype=torch.float32, device=device),
            torch.empty(plan.workspace_lse_numel, dtype=torch.float32, device=device))


@triton.jit
def _mla_decode_split_kernel(
    q_ptr,  # [B * q_len, H, L + R]
    kv_ptr,  # [num_blocks, BLOCK_SIZE, L + R]
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    o_ptr,  # [B, num_splits, q_len * H, L]: partial (float32) or final (q dtype) output
    lse_ptr,  # [B, num_splits, q_len * H] float32
    qk_scale,  # softmax_scale * log2(e)
    q_len,
    num_heads,
    num_splits,
    min_split_len,  # a multiple of BLOCK_N
    stride_q_token,
    stride_q_head,
    stride_kv_block,
    stride_kv_slot,
    stride_bt,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT_OUTPUT: tl.constexpr,
):
    group = tl.program_id(0)
    split = tl.program_id(1)
    req = tl.program_id(2)
    num_rows = q_len * num_heads

    seq_len = tl.load(seq_lens_ptr + req)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, min_split_len)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    rows = group * BLOCK_M + tl.arange(0, BLOCK_M)  # row r = t * H + h of this request
    row_mask = rows < num_rows
    token = rows // num_heads
    head = rows % num_heads
    q_offs = (req * q_len + token).to(tl.int64) * stride_q_token + head * stride_q_head
    offs_l = tl.arange(0, KV_LORA_RANK)
    offs_r = tl.arange(0, ROPE_DIM)
    q_nope = tl.load(q_ptr + q_offs[:, None] + offs_l[None, :], mask=row_mask[:, None], other=0.0)
    q_pe = tl.load(q_ptr + q_offs[:, None] + KV_LORA_RANK + offs_r[None, :],
                   mask=row_mask[:, None], other=0.0)
    # Token t of the request sits at position seq_len - q_len + t and sees keys up to there.
    last_key = seq_len - q_len + token  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, KV_LORA_RANK], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in tl.range(split_start, split_end, BLOCK_N, num_stages=NUM_STAGES):
        pos = start + offs_n  # [BLOCK_N] key positions
        key_mask = pos < split_end
        if BLOCK_SIZE >= BLOCK_N:
            # Splits start on tile boundaries, so the whole tile lies in one page.
            page = tl.load(bt_row + start // BLOCK_SIZE).to(tl.int64)
            kv_offs = page * stride_kv_block + (start % BLOCK_SIZE + offs_n) * stride_kv_slot
        else:
            page = tl.load(bt_row + pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
            kv_offs = page * stride_kv_block + (pos % BLOCK_SIZE) * stride_kv_slot
        k_nope = tl.load(kv_ptr + kv_offs[:, None] + offs_l[None, :], mask=key_mask[:, None],
                         other=0.0)  # [BLOCK_N, L], also V
        k_pe = tl.load(kv_ptr + kv_offs[:, None] + KV_LORA_RANK + offs_r[None, :],
                       mask=key_mask[:, None], other=0.0)  # [BLOCK_N, R]
        scores = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), acc=scores, input_precision=DOT_PRECISION)
        visible = key_mask[None, :] & (pos[None, :] <= last_key[:, None])  # [BLOCK_M, BLOCK_N]
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # Rows that have seen no key yet keep m = -inf; subtract 0 there instead (no inf - inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(k_nope.dtype), k_nope, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # natural log; -inf where no key
    base = req.to(tl.int64) * num_splits + split  # (request, split) index
    o_offs = (base * num_rows + rows)[:, None] * KV_LORA_RANK + offs_l[None, :]
    if DIRECT_OUTPUT:
        o_mask = row_mask
    else:
        o_mask = row_mask & (l_i > 0.0)  # the merge never reads an empty split's output
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=o_mask[:, None])
    tl.store(lse_ptr + base * num_rows + rows, lse, mask=row_mask)


@triton.jit
def _mla_decode_merge_kernel(
    partial_o_ptr,  # [B, num_splits, q_len * H, L] float32
    partial_lse_ptr,  # [B, num_splits, q_len * H] float32
    o_ptr,  # [B, q_len * H, L] q dtype
    lse_ptr,  # [B, q_len * H] float32
    num_rows,  # q_len * H
    num_splits,
    KV_LORA_RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row_block = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    offs_l = tl.arange(0, KV_LORA_RANK)
    lse_base = partial_lse_ptr + req * num_splits * num_rows + rows

    lse_max = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for split in range(num_splits):
        lse_split = tl.load(lse_base + split * num_rows, mask=row_mask, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse_split)
    lse_max_safe = tl.where(lse_max == float("-inf"), 0.0, lse_max)

    weight_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, KV_LORA_RANK], dtype=tl.float32)
    for split in range(num_splits):
        lse_split = tl.load(lse_base + split * num_rows, mask=row_mask, other=float("-inf"))
        weight = tl.exp(lse_split - lse_max_safe)  # 0 for empty splits
        o_offs = ((req * num_splits + split) * num_rows + rows)[:, None] * KV_LORA_RANK
        part = tl.load(partial_o_ptr + o_offs + offs_l[None, :],
                       mask=(row_mask & (weight > 0.0))[:, None], other=0.0)  # [BLOCK_R, L]
        acc += weight[:, None] * part
        weight_sum += weight

    no_key = weight_sum == 0.0  # every split was empty
    weight_sum = tl.where(no_key, 1.0, weight_sum)
    out = acc / weight_sum[:, None]
    lse = tl.where(no_key, float("-inf"), lse_max_safe + tl.log(weight_sum))
    out_offs = (req * num_rows + rows)[:, None] * KV_LORA_RANK + offs_l[None, :]
    tl.store(o_ptr + out_offs, out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])
    tl.store(lse_ptr + req * num_rows + rows, lse, mask=row_mask)


def _check_pow2(name: str, value: int, minimum: int) -> None:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def mla_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    q_len: int,
    num_splits: int,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: MLADecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode (split-KV + merge); launches one or two kernels and never syncs.

    Args:
        q: [B * q_len, H, L + R] absorbed queries `[q_latent | q_pe]`, request-major rows;
            bfloat16, float16 or float32; the last dim contiguous.
        kv_cache: [num_blocks, block_size, L + R] latent cache `[c_kv | k_pe]`, q's dtype, the
            last dim contiguous; block_size a power of two.
        block_table: [B, max_blocks] int32 page ids per request (entries past a request's
            length are never read).
        seq_lens: [B] int32 KV length per request including the q_len new tokens; 0 allowed.
        softmax_scale: multiplies q.k before the softmax.
        kv_lora_rank: L (a power of two >= 16); R = q.shape[-1] - L (a power of two >= 16).
        q_len: new tokens per request, causal among themselves.
        num_splits: KV splits per request (from `plan_mla_decode`; any value >= 1 is correct).
        workspace: (partial_o, partial_lse) float32 buffers of at least the plan's sizes, from
            `alloc_workspace`; allocated here when None. Unused with num_splits == 1.
        config: launch configuration (normally the plan's); `default_config` of the shape when
            None. Any configuration is correct with any split count.

    Returns:
        o: [B * q_len, H, L] in q's dtype (zero for rows that see no key).
        lse: [B * q_len, H] float32, natural log (-inf for rows that see no key).
    """
    num_tokens, num_heads, head_dim = q.shape
    batch = block_table.shape[0]
    block_size = kv_cache.shape[1]
    rope_dim = head_dim - kv_lora_rank
    if num_tokens != batch * q_len:
        raise ValueError(f"q has {num_tokens} rows, expected B * q_len = {batch} * {q_len}")
    if kv_cache.shape[2] != head_dim or kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match q "
                         f"{tuple(q.shape)} {q.dtype}")
    _check_pow2("kv_lora_rank", kv_lora_rank, 16)
    _check_pow2("qk_rope_head_dim", rope_dim, 16)
    _check_pow2("block_size", block_size, 1)
    if config is None:
        config = default_config(num_heads, q_len, kv_lora_rank, rope_dim, q.dtype, batch,
                                block_table.shape[1] * block_size, block_size)
    # Splits must start on tile boundaries (a tile then never straddles a page).
    min_split_len = triton.cdiv(max(config.min_split_len, 1), config.block_n) * config.block_n
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    block_table = block_table.to(torch.int32)
    seq_lens = seq_lens.to(torch.int32)
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()

    o = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return o, lse
    rows = q_len * num_heads
    num_head_groups = triton.cdiv(rows, config.block_m)
    direct = num_splits == 1
    if direct:
        partial_o, partial_lse = o, lse  # [B, 1, q_len * H, L] and [B, 1, q_len * H] views
    else:
        o_numel = batch * num_splits * rows * kv_lora_rank
        lse_numel = batch * num_splits * rows
        if workspace is None:
            workspace = (torch.empty(o_numel, dtype=torch.float32, device=q.device),
                         torch.empty(lse_numel, dtype=torch.float32, device=q.device))
        partial_o, partial_lse = workspace
        if partial_o.numel() < o_numel or partial_lse.numel() < lse_numel:
            raise ValueError(f"workspace too small: need {o_numel} and {lse_numel} float32, got "
                             f"{partial_o.numel()} and {partial_lse.numel()}")
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _mla_decode_split_kernel[(num_head_groups, num_splits, batch)](
        q, kv_cache, block_table, seq_lens, partial_o, partial_lse,
        softmax_scale * _LOG2E, q_len, num_heads, num_splits, min_split_len,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, NUM_STAGES=config.num_stages,
        DOT_PRECISION=precision, DIRECT_OUTPUT=direct,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if not direct:
        block_rows = min(config.merge_block_rows, _next_pow2(rows))
        _mla_decode_merge_kernel[(triton.cdiv(rows, block_rows), batch)](
            partial_o, partial_lse, o, lse, rows, num_splits,
            KV_LORA_RANK=kv_lora_rank, BLOCK_R=block_rows, num_warps=config.merge_num_warps,
        )
    return o, lse


__all__ = [
    "MLADecodeConfig",
    "MLADecodePlan",
    "alloc_workspace",
    "default_config",
    "mla_decode_triton",
    "plan_mla_decode",
]
