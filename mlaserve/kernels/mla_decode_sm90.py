"""Warp-specialised split pass of the paged MLA decode for 64-row programs on sm_90 (Gluon).

The same problem, split arithmetic and output layout as `_mla_decode_split_kernel` in
`mla_decode.py` (whose merge kernel finishes the job), for the compute-bound shapes: 64 query
rows per program (128 heads, or 16 heads x q_len 4) with kv_lora_rank 512 and 16-bit data.
Triton's pipeliner keeps such a program's two warpgroups in lockstep with the loads and leaves
the tensor cores idle during the softmax; here the work is laid out by hand:

- A 1-warp loader partition issues TMA copies: the program's Q rows [64, L] and [64, R] once,
  then each KV tile [BLOCK_N, L] and [BLOCK_N, R] of the split (one page id per tile) into a
  ring of NUM_STAGES shared buffers guarded by ready / empty mbarriers.
- The 8-warp default partition (two warpgroups) owns the accumulator [64, L] float32, each
  warpgroup 256 of the L columns, and keeps the tensor cores fed over the tiles j:
      issue O += P_j V_j (wgmma, async)    issue S_{j+1} = Q K_{j+1}^T (wgmma, async)
      wait for P_j V_j; release tile j's buffer to the loader (S_{j+1} still runs)
      wait for S_{j+1}; its online softmax -> P_{j+1}; rescale O by the new maximum
  With two 64-token buffers the loader can refill a buffer only once its P V product is done,
  so releasing it before S_{j+1} finishes hides most of the next load: 164 against 220 µs at
  128 heads x 64 x 4096 for the other order (OVERLAP_SOFTMAX: S_{j+1} first, its softmax beside
  P_j V_j), benchmarks/2026-12-02-h200-mla-decode-gluon/. S is split by columns over the two
  warpgroups ([4, 2] warps), so its row max and sum and the conversion of P to the wgmma
  register operand go through shared memory.
- V is the [BLOCK_N, L] buffer of the tile itself. A split's partial last tile has its rows
  past the length zeroed in shared memory before its P V product (the page tail may hold NaN,
  and P = 0 times NaN is NaN); their scores are masked to -inf like every invisible key.

Scores are computed in base 2 (qk_scale = softmax_scale * log2(e)); lse is returned in natural
log. Needs triton.experimental.gluon (Triton >= 3.6) and an sm_90 GPU; `supported` says when.
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M = 64  # query rows per program
NUM_WARPS = 8  # the default (compute) partition: two warpgroups
SHARED_MEMORY_LIMIT = 227 * 1024
# Scores split by columns over the two warpgroups (False) or computed whole by each (True).
FULL_SCORES = False
# Issue S_{j+1} before P_j V_j and run the softmax of S_{j+1} beside that product (True), or
# issue P_j V_j first and release tile j's buffer before S_{j+1} is done (False).
OVERLAP_SOFTMAX = False
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _loader_partition(q_nope_desc, q_pe_desc, kv_nope_desc, kv_pe_desc, q_nope_smem, q_pe_smem,
                      kv_nope_smem, kv_pe_smem, q_ready, kv_ready, kv_empty, bt_row, q_row,
                      split_start, num_tiles, BLOCK_SIZE: gl.constexpr):
    """1 warp: TMA copies of Q once and of each KV tile into the ring (tile j -> buffer j % S)."""
    STAGES: gl.constexpr = kv_nope_smem.type.shape[0]
    TILE: gl.constexpr = kv_nope_smem.type.shape[1]
    L: gl.constexpr = kv_nope_smem.type.shape[2]
    mbarrier.expect(q_ready, q_nope_desc.block_type.nbytes + q_pe_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_nope_desc, [q_row, 0], q_ready, q_nope_smem)
    tma.async_copy_global_to_shared(q_pe_desc, [q_row, L], q_ready, q_pe_smem)
    tile_bytes: gl.constexpr = kv_nope_desc.block_type.nbytes + kv_pe_desc.block_type.nbytes
    for j in range(num_tiles):
        stage = j % STAGES
        start = split_start + j * TILE
        page = gl.load(bt_row + start // BLOCK_SIZE)
        cache_row = page * BLOCK_SIZE + start % BLOCK_SIZE
        # A fresh barrier counts as having completed the phase before phase 0: parity 1 passes.
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        ready = kv_ready.index(stage)
        mbarrier.expect(ready, tile_bytes)
        tma.async_copy_global_to_shared(kv_nope_desc, [cache_row, 0], ready,
                                        kv_nope_smem.index(stage))
        tma.async_copy_global_to_shared(kv_pe_desc, [cache_row, L], ready,
                                        kv_pe_smem.index(stage))


@gluon.jit
def _issue_scores(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, kv_ready, j,
                  S_LAYOUT: gl.constexpr):
    """Wait for tile j and issue S = Q_nope K_nope^T + Q_pe K_pe^T [64, BLOCK_N] (async)."""
    STAGES: gl.constexpr = kv_nope_smem.type.shape[0]
    TILE: gl.constexpr = kv_nope_smem.type.shape[1]
    ROWS: gl.constexpr = q_nope_smem.type.shape[0]
    stage = j % STAGES
    mbarrier.wait(kv_ready.index(stage), (j // STAGES) & 1)
    zeros = gl.zeros([ROWS, TILE], gl.float32, S_LAYOUT)
    token = warpgroup_mma(q_nope_smem, kv_nope_smem.index(stage).permute((1, 0)), zeros,
                          use_acc=False, is_async=True)
    return warpgroup_mma(q_pe_smem, kv_pe_smem.index(stage).permute((1, 0)), token,
                         is_async=True)


@gluon.jit
def _softmax_step(scores, m_i, l_i, tile_start, split_end, last_key, qk_scale,
                  S_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr, dtype: gl.constexpr):
    """Online softmax (base 2) of one tile's scores [64, BLOCK_N]: returns P in the wgmma
    register-operand layout, the rescale factor alpha [64] and the new m_i, l_i [64]."""
    TILE: gl.constexpr = scores.type.shape[1]
    pos = tile_start + gl.arange(0, TILE, layout=gl.SliceLayout(0, S_LAYOUT))  # [BLOCK_N]
    visible = (gl.expand_dims(pos < split_end, 0)
               & (gl.expand_dims(pos, 0) <= gl.expand_dims(last_key, 1)))  # [64, BLOCK_N]
    scores = gl.where(visible, scores * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, axis=1))
    # Rows that have seen no key yet keep m = -inf; subtract 0 there instead (no inf - inf).
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(scores - gl.expand_dims(m_safe, 1))
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(dtype), P_LAYOUT), alpha, m_new, l_new


@gluon.jit
def _zero_rows_past(kv_nope_smem, stage, num_valid, num_warps: gl.constexpr):
    """Zero rows >= num_valid of buffer `stage`'s [BLOCK_N, L] tile, 64 columns at a time."""
    TILE: gl.constexpr = kv_nope_smem.type.shape[1]
    L: gl.constexpr = kv_nope_smem.type.shape[2]
    CHUNK: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.expand_dims(gl.arange(0, TILE, layout=gl.SliceLayout(1, CHUNK)), 1)
    tile = kv_nope_smem.index(stage)
    for c in gl.static_range(L // 64):
        piece = tile.slice(c * 64, 64, dim=1)  # [BLOCK_N, 64]
        values = piece.load(CHUNK)
        piece.store(gl.where(rows < num_valid, values, gl.zeros_like(values)))
    fence_async_shared()  # make the generic-proxy stores visible to wgmma
    gl.thread_barrier()


@gluon.jit
def _compute_partition(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, q_ready, kv_ready,
                       kv_empty, o_ptr, lse_ptr, qk_scale, q_len, num_heads, num_rows, group,
                       out_base, seq_len, split_start, split_end, num_tiles,
                       S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr,
                       DIRECT_OUTPUT: gl.constexpr, OVERLAP_SOFTMAX: gl.constexpr,
                       num_warps: gl.constexpr):
    """8 warps: the pipelined tile loop (module docstring) and the output of the split."""
    STAGES: gl.constexpr = kv_nope_smem.type.shape[0]
    TILE: gl.constexpr = kv_nope_smem.type.shape[1]
    L: gl.constexpr = kv_nope_smem.type.shape[2]
    ROWS: gl.constexpr = q_nope_smem.type.shape[0]
    dtype: gl.constexpr = kv_nope_smem.type.element_ty
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

    rows_s = group * ROWS + gl.arange(0, ROWS, layout=ROW_S)  # row r = t * H + h
    # Token t of the request sits at position seq_len - q_len + t and sees keys up to there.
    last_key = seq_len - q_len + rows_s // num_heads  # [64]
    m_i = gl.full([ROWS], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([ROWS], gl.float32, ROW_S)
    acc = gl.zeros([ROWS, L], gl.float32, O_LAYOUT)
    mbarrier.wait(q_ready, 0)
    if num_tiles > 0:
        token = _issue_scores(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, kv_ready, 0,
                              S_LAYOUT)
        scores = warpgroup_mma_wait(0, deps=[token])
        p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i, split_start, split_end, last_key,
                                           qk_scale, S_LAYOUT, P_LAYOUT, dtype)
        for j in range(num_tiles - 1):
            stage = j % STAGES
            if OVERLAP_SOFTMAX:
                s_token = _issue_scores(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem,
                                        kv_ready, j + 1, S_LAYOUT)
                o_token = warpgroup_mma(p, kv_nope_smem.index(stage), acc, is_async=True)
                scores = warpgroup_mma_wait(1, deps=[s_token])  # S_{j+1} done; P_j V_j runs on
                p_next, alpha, m_i, l_i = _softmax_step(
                    scores, m_i, l_i, split_start + (j + 1) * TILE, split_end, last_key,
                    qk_scale, S_LAYOUT, P_LAYOUT, dtype)
                # P_j (a register operand) stays live until its product is done.
                acc, p = warpgroup_mma_wait(0, deps=[o_token, p])
                mbarrier.arrive(kv_empty.index(stage))  # the loader may refill tile j's buffer
            else:  # P_j V_j first: tile j's buffer is released one S product earlier
                o_token = warpgroup_mma(p, kv_nope_smem.index(stage), acc, is_async=True)
                s_token = _issue_scores(q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem,
                                        kv_ready, j + 1, S_LAYOUT)
                acc, p = warpgroup_mma_wait(2, deps=[o_token, p])  # S_{j+1}'s two may run on
                mbarrier.arrive(kv_empty.index(stage))
                scores = warpgroup_mma_wait(0, deps=[s_token])
                p_next, alpha, m_i, l_i = _softmax_step(
                    scores, m_i, l_i, split_start + (j + 1) * TILE, split_end, last_key,
                    qk_scale, S_LAYOUT, P_LAYOUT, dtype)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            p = p_next
        last = num_tiles - 1
        stage = last % STAGES
        num_valid = split_end - (split_start + last * TILE)
        if num_valid < TILE:
            _zero_rows_past(kv_nope_smem, stage, num_valid, num_warps)
        o_token = warpgroup_mma(p, kv_nope_smem.index(stage), acc, is_async=True)
        acc, p = warpgroup_mma_wait(0, deps=[o_token, p])
        mbarrier.arrive(kv_empty.index(stage))

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453  # natural log; -inf where no key
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, ROW_O), 1)
    rows_o = group * ROWS + gl.arange(0, ROWS, layout=ROW_O)
    cols = gl.arange(0, L, layout=gl.SliceLayout(0, O_LAYOUT))
    o_offs = gl.expand_dims((out_base + rows_o) * L, 1) + gl.expand_dims(cols, 0)
    row_ok = rows_o < num_rows
    if not DIRECT_OUTPUT:
        row_ok = row_ok & (gl.convert_layout(l_i, ROW_O) > 0.0)  # the merge skips empty splits
    o_mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < L, 0)
    gl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=o_mask)
    gl.store(lse_ptr + out_base + rows_s, lse, mask=rows_s < num_rows)


@gluon.jit
def _mla_decode_split_kernel_sm90(
    q_nope_desc,  # q [B * q_len * H, L + R]: box [64, L] at column 0
    q_pe_desc,  # the same rows: box [64, R] at column L
    kv_nope_desc,  # cache [num_blocks * BLOCK_SIZE, L + R]: box [BLOCK_N, L] at column 0
    kv_pe_desc,  # the same rows: box [BLOCK_N, R] at column L
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    o_ptr,  # [B, num_splits, q_len * H, L]: partial (float32) or final (q dtype) output
    lse_ptr,  # [B, num_splits, q_len * H] float32
    qk_scale,  # softmax_scale * log2(e)
    q_len,
    num_heads,
    num_splits,
    min_split_len,  # a multiple of BLOCK_N
    stride_bt,
    BLOCK_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    DIRECT_OUTPUT: gl.constexpr,
    FULL_SCORES: gl.constexpr,
    OVERLAP_SOFTMAX: gl.constexpr,
    num_warps: gl.constexpr,
):
    ROWS: gl.constexpr = q_nope_desc.block_type.shape[0]
    L: gl.constexpr = q_nope_desc.block_type.shape[1]
    TILE: gl.constexpr = kv_nope_desc.block_type.shape[0]
    gl.static_assert(num_warps == 8)
    # wgmma layouts: 4 warps x 16 rows cover the 64 rows, the two warpgroups split the columns
    # (or, FULL_SCORES, each warpgroup computes all of S: twice the Q K^T work, no exchange).
    if FULL_SCORES:
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                           instr_shape=[16, TILE, 16])
    else:
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, TILE // 2, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, L // 2, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)

    group = gl.program_id(0)
    split = gl.program_id(1)
    req = gl.program_id(2)
    num_rows = q_len * num_heads
    seq_len = gl.load(seq_lens_ptr + req)
    split_len = gl.cdiv(gl.cdiv(seq_len, num_splits), TILE) * TILE
    split_len = gl.maximum(split_len, min_split_len)
    split_start = split * split_len
    split_end = gl.minimum(split_start + split_len, seq_len)
    num_tiles = gl.cdiv(gl.maximum(split_end - split_start, 0), TILE)
    q_row = req * num_rows + group * ROWS
    # First output row of this (request, split).
    out_base = (req.to(gl.int64) * num_splits + split) * num_rows
    bt_row = block_table_ptr + req.to(gl.int64) * stride_bt

    dtype: gl.constexpr = kv_nope_desc.dtype
    q_nope_smem = gl.allocate_shared_memory(dtype, q_nope_desc.block_type.shape,
                                            q_nope_desc.layout)
    q_pe_smem = gl.allocate_shared_memory(dtype, q_pe_desc.block_type.shape, q_pe_desc.layout)
    kv_nope_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, TILE, L], kv_nope_desc.layout)
    kv_pe_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + kv_pe_desc.block_type.shape,
                                           kv_pe_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_compute_partition, (q_nope_smem, q_pe_smem, kv_nope_smem, kv_pe_smem, q_ready,
                              kv_ready, kv_empty, o_ptr, lse_ptr, qk_scale, q_len, num_heads,
                              num_rows, group, out_base, seq_len, split_start, split_end,
                              num_tiles, S_LAYOUT, O_LAYOUT, P_LAYOUT, DIRECT_OUTPUT,
                              OVERLAP_SOFTMAX, num_warps)),
        (_loader_partition, (q_nope_desc, q_pe_desc, kv_nope_desc, kv_pe_desc, q_nope_smem,
                             q_pe_smem, kv_nope_smem, kv_pe_smem, q_ready, kv_ready, kv_empty,
                             bt_row, q_row, split_start, num_tiles, BLOCK_SIZE)),
    ], [1], [24])


@functools.cache
def _shared_layout(dtype: torch.dtype, rows: int, width: int) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, width], _GL_DTYPES[dtype])


def shared_memory_bytes(kv_lora_rank: int, rope_dim: int, block_n: int, num_stages: int) -> int:
    """Q [64, L + R] plus num_stages KV tiles [block_n, L + R] (16-bit), plus 8 KB for barriers
    and layout-conversion scratch (4.1 KB compiled at L 512, R 64)."""
    return 2 * (kv_lora_rank + rope_dim) * (BLOCK_M + num_stages * block_n) + 8192


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def supported(device: torch.device, dtype: torch.dtype, kv_lora_rank: int, rope_dim: int,
              block_m: int, block_n: int, num_stages: int, block_size: int) -> bool:
    """Whether `launch_split_pass` serves the shape: sm_90, 16-bit data, L = 512 (two warpgroups
    of 256 columns), R <= 256, 64-row programs, tiles of 32 or more tokens within a page, and
    the ring of num_stages tiles in shared memory."""
    return (_is_sm90(device) and dtype in _GL_DTYPES and kv_lora_rank == 512
            and 16 <= rope_dim <= 256
            and block_m == BLOCK_M and 32 <= block_n <= block_size and num_stages >= 2
            and shared_memory_bytes(kv_lora_rank, rope_dim, block_n, num_stages)
            <= SHARED_MEMORY_LIMIT)


def launch_split_pass(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    partial_o: torch.Tensor,
    partial_lse: torch.Tensor,
    qk_scale: float,
    kv_lora_rank: int,
    q_len: int,
    num_splits: int,
    min_split_len: int,
    block_n: int,
    num_stages: int,
) -> None:
    """Stage 1 of `mla_decode_triton` for a shape where `supported` holds.

    Args:
        q: [B * q_len, H, L + R] contiguous; kv_cache [num_blocks, block_size, L + R] with its
            pages back to back; block_table [B, max_blocks] int32; seq_lens [B] int32.
        partial_o, partial_lse: [B, num_splits, q_len * H, L] and [B, num_splits, q_len * H]
            (flat): float32 partials, or with num_splits == 1 the final o (q's dtype) and lse.
        qk_scale: softmax_scale * log2(e). kv_lora_rank: L. min_split_len: a multiple of
            block_n, the KV tokens per tile; num_stages: KV tiles in the shared ring.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    rope_dim = head_dim - kv_lora_rank
    q_rows = q.view(num_tokens * num_heads, head_dim)  # [B * q_len * H, L + R]
    kv_rows = kv_cache.view(num_blocks * block_size, head_dim)  # [num_blocks * block_size, L + R]
    descs = [TensorDescriptor.from_tensor(tensor, [rows, width],
                                          _shared_layout(q.dtype, rows, width))
             for tensor, rows in ((q_rows, BLOCK_M), (kv_rows, block_n))
             for width in (kv_lora_rank, rope_dim)]
    batch = block_table.shape[0]
    rows = q_len * num_heads
    grid = (triton.cdiv(rows, BLOCK_M), num_splits, batch)
    _mla_decode_split_kernel_sm90[grid](
        *descs, block_table, seq_lens, partial_o, partial_lse, qk_scale, q_len, num_heads,
        num_splits, min_split_len, block_table.stride(0), BLOCK_SIZE=block_size,
        NUM_STAGES=num_stages, DIRECT_OUTPUT=num_splits == 1, FULL_SCORES=FULL_SCORES,
        OVERLAP_SOFTMAX=OVERLAP_SOFTMAX, num_warps=NUM_WARPS)


def compile_for_sm90(
    dtype: torch.dtype = torch.bfloat16,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    block_n: int = 64,
    num_stages: int = 2,
    block_size: int = 64,
    direct_output: bool = False,
):
    """Compile the split pass for sm_90 without a GPU (Triton's bundled ptxas), with the
    argument specialisation a launch gets; returns Triton's CompiledKernel (asm["ptx"],
    asm["cubin"], metadata.shared). For resource checks in tests and scripts."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = _mla_decode_split_kernel_sm90
    type_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    signature = {}
    for name, rows, width in (("q_nope_desc", BLOCK_M, kv_lora_rank),
                              ("q_pe_desc", BLOCK_M, rope_dim),
                              ("kv_nope_desc", block_n, kv_lora_rank),
                              ("kv_pe_desc", block_n, rope_dim)):
        layout = _shared_layout(dtype, rows, width)
        signature[name] = f"tensordesc<{type_name}[{rows}, {width}],{layout!r}>"
    constexprs = dict(BLOCK_SIZE=block_size, NUM_STAGES=num_stages, DIRECT_OUTPUT=direct_output,
                      FULL_SCORES=FULL_SCORES, OVERLAP_SOFTMAX=OVERLAP_SOFTMAX,
                      num_warps=NUM_WARPS)
    signature |= {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                  "o_ptr": f"*{type_name}" if direct_output else "*fp32", "lse_ptr": "*fp32",
                  "qk_scale": "fp32", "q_len": "i32", "num_heads": "i32", "num_splits": "i32",
                  "min_split_len": "i32", "stride_bt": "i32"}
    signature |= {name: "constexpr" for name in constexprs}
    aligned = ["block_table_ptr", "seq_lens_ptr", "o_ptr", "lse_ptr", "stride_bt"]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})


__all__ = ["compile_for_sm90", "launch_split_pass", "supported"]
