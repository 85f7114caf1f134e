"""The Triton split pass of the paged MLA decode (stage 1; the merge is `merge.py`).

The problem (absorbed MLA decode: docs/architecture.md, "MLA conventions", "Contracts"). Per
request b with KV length N_b and q_len new tokens, the M = q_len * H query rows
`[q_latent | q_pe]` (L + R wide) attend all cached rows `[c_kv | k_pe]` of that request, causal
among the new tokens; V is the first L columns of the same cache rows. The output is
o [B * q_len, H, L] in q's dtype and lse [B * q_len, H] (natural log, float32).

Kernel design:
- `_mla_decode_split_kernel`: one program per (head group, split, request). A head group
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
- Pages: with block_size >= block_n a tile lies inside one page (one page id per tile); the page
  ids of a split are loaded as a vector before its tile loop, up to 64 tiles at a time, so no
  load in the loop depends on another load of the loop and Triton's pipeliner gives the KV
  loads every stage. Smaller pages that divide the tile are read the same way, as
  [tiles, pages per tile] ids, and each row of a tile takes its page's id; other page sizes are
  gathered row by row through the block table inside the loop. Loads past
  the request's length are masked (other=0) and their scores set to -inf, so NaN in unused
  pages or in the tail of the last page never reaches the output.
- With `plan.tma_loads` (64-row programs on sm_90 and newer; any program where the config
  asks, e.g. over an FP8 cache) whole tiles are loaded by TMA from tensor descriptors over the
  cache's rows; a split's partial last tile always takes the masked pointer loads, so rows
  past the length never enter a dot.
- An FP8 cache's tiles are converted to q's dtype (float16 under a bfloat16 q) at each of
  their two uses, in registers, from the loaded tile (`gluon_sm90_fp8.py` says why a pass of
  its own converts them once instead).
- Latent chunks (`MLADecodeConfig.latent_chunks` C > 1): q, each tile's c_kv and the
  accumulator are held as [C, rows, L / C], and the two latent dots become C batched dots
  (the scores summed over the chunks). A 16-row dot spreads its warps over the keys, so
  every warp holds all of q [16, L] as an operand (128 registers per thread at L = 512 in
  16-bit); batched dots spread the warps over the chunks instead, one chunk of q, of the tile
  and of the accumulator per warp. It rescales the accumulator only in tiles where some row's
  running max grew (alpha is exactly 1 elsewhere). Compiled for sm_90 with pipelined FP8 TMA
  tiles of 16 tokens, its tile loop has no register spill (the 2-d form spills there); its
  speed is not measured yet, so no plan picks it by default.

The plan (`plan.py`) fixes every choice; `launch.py` checks the inputs and calls
`launch_split_pass` here (and `merge.launch_merge` after it) as the plan says.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents
from triton.tools.tensor_descriptor import TensorDescriptor

from mlaserve.kernels.mla_decode.common import SplitPassIO
from mlaserve.kernels.mla_decode.plan import MLADecodePlan
from mlaserve.kernels.mla_decode.splits import split_bounds


@triton.jit
def _online_softmax(scores, pos, key_mask, last_key, qk_scale, m_i, l_i):
    """Scale and mask one tile's scores [BLOCK_M, BLOCK_N] (keys at positions pos [BLOCK_N],
    row r sees keys up to last_key[r]) and step the online softmax (base 2): returns the
    probabilities p [BLOCK_M, BLOCK_N], the rescale factor alpha of the old accumulator, and
    the new running max m_i and sum l_i [BLOCK_M]."""
    visible = key_mask[None, :] & (pos[None, :] <= last_key[:, None])  # [BLOCK_M, BLOCK_N]
    scores = tl.where(visible, scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # Rows that have seen no key yet keep m = -inf; subtract 0 there instead (no inf - inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _attend_tile(q_nope, q_pe, k_nope, k_pe, pos, key_mask, last_key, qk_scale, acc, m_i, l_i,
                 DOT_PRECISION: tl.constexpr):
    """One KV tile of the online softmax: q [BLOCK_M, L] and [BLOCK_M, R] against the tile's
    k_nope [BLOCK_N, L] (also V) and k_pe [BLOCK_N, R] at key positions pos [BLOCK_N], the tile
    in the cache's dtype (converted to q's here); returns the updated acc [BLOCK_M, L], running
    max m_i and sum l_i [BLOCK_M] (base 2)."""
    k_nope = k_nope.to(q_pe.dtype)
    scores = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PRECISION)
    scores = tl.dot(q_pe, tl.trans(k_pe.to(q_pe.dtype)), acc=scores,
                    input_precision=DOT_PRECISION)
    p, alpha, m_i, l_i = _online_softmax(scores, pos, key_mask, last_key, qk_scale, m_i, l_i)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(k_nope.dtype), k_nope, acc=acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _attend_tile_split_latent(q_nope, q_pe, k_nope, k_pe, pos, key_mask, last_key, qk_scale,
                              acc, m_i, l_i, DOT_PRECISION: tl.constexpr):
    """`_attend_tile` with the latent in C column chunks: q_nope [C, BLOCK_M, L / C], the
    tile's k_nope [BLOCK_N, C, L / C] (as loaded; also V) and acc [C, BLOCK_M, L / C]. The
    scores are C batched dots [BLOCK_M, L / C] x [L / C, BLOCK_N] summed over the chunks, and
    P V is C batched dots of the same P with each chunk of V. Batched dots spread their batch
    over the warps, so a warp holds one chunk of q, of the tile and of the accumulator where
    the [BLOCK_M, L] x [L, BLOCK_N] dot of a 16-row program needs all of q in every warp."""
    k_chunks = tl.permute(k_nope, (1, 0, 2)).to(q_pe.dtype)  # [C, BLOCK_N, L / C]
    scores = tl.sum(tl.dot(q_nope, tl.permute(k_chunks, (0, 2, 1)),
                           input_precision=DOT_PRECISION), 0)  # [BLOCK_M, BLOCK_N]
    scores = tl.dot(q_pe, tl.trans(k_pe.to(q_pe.dtype)), acc=scores,
                    input_precision=DOT_PRECISION)
    p, alpha, m_new, l_i = _online_softmax(scores, pos, key_mask, last_key, qk_scale, m_i, l_i)
    p = tl.broadcast_to(p.to(q_pe.dtype)[None, :, :],
                        (k_chunks.shape[0], p.shape[0], p.shape[1]))  # [C, BLOCK_M, BLOCK_N]
    # Rescale only when some row's max grew (else alpha is exactly 1 in every row): once the
    # maxima settle, most tiles skip the C x BLOCK_M x L / C multiplies.
    if tl.max((m_new > m_i).to(tl.int32), 0) > 0:
        acc = acc * alpha[None, :, None]
    acc = tl.dot(p, k_chunks, acc=acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend(q_nope, q_pe, k_nope, k_pe, pos, key_mask, last_key, qk_scale, acc, m_i, l_i,
            DOT_PRECISION: tl.constexpr, LATENT_CHUNKS: tl.constexpr):
    """`_attend_tile`, or `_attend_tile_split_latent` with LATENT_CHUNKS > 1."""
    if LATENT_CHUNKS == 1:
        return _attend_tile(q_nope, q_pe, k_nope, k_pe, pos, key_mask, last_key, qk_scale, acc,
                            m_i, l_i, DOT_PRECISION)
    else:
        return _attend_tile_split_latent(q_nope, q_pe, k_nope, k_pe, pos, key_mask, last_key,
                                         qk_scale, acc, m_i, l_i, DOT_PRECISION)


@triton.jit
def _masked_tile(kv_ptr, kv_offs, key_mask, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
                 LATENT_CHUNKS: tl.constexpr):
    """Pointer loads of one KV tile at row offsets kv_offs [BLOCK_N], in the cache's dtype:
    k_nope [BLOCK_N, L], or [BLOCK_N, C, L / C] with C = LATENT_CHUNKS > 1 (also V), and k_pe
    [BLOCK_N, R]; zeros where key_mask is off (page tails may hold NaN)."""
    if LATENT_CHUNKS == 1:
        offs_l = tl.arange(0, KV_LORA_RANK)
        k_nope = tl.load(kv_ptr + kv_offs[:, None] + offs_l[None, :], mask=key_mask[:, None],
                         other=0.0)
    else:
        chunk: tl.constexpr = KV_LORA_RANK // LATENT_CHUNKS
        cols = (tl.arange(0, LATENT_CHUNKS)[:, None] * chunk
                + tl.arange(0, chunk)[None, :])  # [C, L / C]
        k_nope = tl.load(kv_ptr + kv_offs[:, None, None] + cols[None, :, :],
                         mask=key_mask[:, None, None], other=0.0)
    offs_r = tl.arange(0, ROPE_DIM)
    k_pe = tl.load(kv_ptr + kv_offs[:, None] + KV_LORA_RANK + offs_r[None, :],
                   mask=key_mask[:, None], other=0.0)
    return k_nope, k_pe


@triton.jit
def _mla_decode_split_kernel(
    q_ptr,  # [B * q_len, H, L + R]
    kv_ptr,  # [num_blocks, BLOCK_SIZE, L + R]
    kv_nope_desc,  # TMA descriptor of kv [num_blocks * BLOCK_SIZE, :L], box [BLOCK_N, L]; or None
    kv_pe_desc,  # TMA descriptor of kv [num_blocks * BLOCK_SIZE, L:], box [BLOCK_N, R]; or None
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    o_ptr,  # [B, num_splits, q_len * H, L]: partial (float32) or final (q dtype) output
    lse_ptr,  # [B, num_splits, q_len * H] float32
    qk_scale,  # softmax_scale * log2(e)
    q_len,
    num_heads,
    num_splits,
    min_split_len,  # a multiple of BLOCK_N
    split_len_ptr,  # [1] int32: the step's least split length (BALANCED only; else unread)
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
    PAGE_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT_OUTPUT: tl.constexpr,
    USE_PDL: tl.constexpr,
    USE_TMA: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    BALANCED: tl.constexpr,
    LATENT_CHUNKS: tl.constexpr,
):
    if USE_PDL:
        # The merge kernel is a programmatic dependent launch: let it be scheduled now (it
        # waits for this whole grid and its stores before reading anything).
        gdc_launch_dependents()
    group = tl.program_id(0)
    split = tl.program_id(1)
    req = tl.program_id(2)
    num_rows = q_len * num_heads

    seq_len = tl.load(seq_lens_ptr + req)
    balanced_len = 0
    if BALANCED:  # the step's split length, planned on the device (split_plan.py)
        balanced_len = tl.load(split_len_ptr)
    split_len, split_start, split_end = split_bounds(seq_len, split, num_splits, min_split_len,
                                                     BLOCK_N, balanced_len)

    rows = group * BLOCK_M + tl.arange(0, BLOCK_M)  # row r = t * H + h of this request
    row_mask = rows < num_rows
    token = rows // num_heads
    head = rows % num_heads
    q_offs = (req * q_len + token).to(tl.int64) * stride_q_token + head * stride_q_head
    offs_r = tl.arange(0, ROPE_DIM)
    chunk: tl.constexpr = KV_LORA_RANK // LATENT_CHUNKS  # latent columns per chunk
    if LATENT_CHUNKS == 1:
        latent_cols = tl.arange(0, KV_LORA_RANK)  # [L]
        q_nope = tl.load(q_ptr + q_offs[:, None] + latent_cols[None, :], mask=row_mask[:, None],
                         other=0.0)  # [BLOCK_M, L]
    else:
        latent_cols = (tl.arange(0, LATENT_CHUNKS)[:, None] * chunk
                       + tl.arange(0, chunk)[None, :])  # [C, L / C]
        q_nope = tl.load(q_ptr + q_offs[None, :, None] + latent_cols[:, None, :],
                         mask=row_mask[None, :, None], other=0.0)  # [C, BLOCK_M, L / C]
    q_pe = tl.load(q_ptr + q_offs[:, None] + KV_LORA_RANK + offs_r[None, :],
                   mask=row_mask[:, None], other=0.0)
    if FP16_DOTS:  # bfloat16 q over an FP8 cache: dots in float16 (`MLADecodePlan.fp16_dots`)
        q_nope = q_nope.to(tl.float16)
        q_pe = q_pe.to(tl.float16)
    # Token t of the request sits at position seq_len - q_len + t and sees keys up to there.
    last_key = seq_len - q_len + token  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if LATENT_CHUNKS == 1:
        acc = tl.zeros([BLOCK_M, KV_LORA_RANK], dtype=tl.float32)
    else:
        acc = tl.zeros([LATENT_CHUNKS, BLOCK_M, chunk], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    tile_ids = tl.arange(0, max(PAGE_CHUNK, 1))
    page_slots = tl.arange(0, max(BLOCK_N // BLOCK_SIZE, 1))  # pages of one tile (small pages)
    # With PAGE_CHUNK > 0 the page ids are read PAGE_CHUNK tiles at a time before the tile loop,
    # so the tile loads in it do not depend on a load of the same loop: the software pipeliner
    # then gives them all NUM_STAGES - 1 buffers (a page-id load in the loop would take half of
    # the stages). PAGE_CHUNK 0: one pass, page ids loaded in the tile loop.
    if PAGE_CHUNK > 0:
        chunk_len = PAGE_CHUNK * BLOCK_N
    else:
        chunk_len = split_len
    if USE_TMA:  # whole tiles by TMA in the loop, a partial last tile after it
        whole_end = split_start + tl.maximum(split_end - split_start, 0) // BLOCK_N * BLOCK_N
    else:
        whole_end = split_end
    for chunk_start in range(split_start, whole_end, chunk_len):
        chunk_end = tl.minimum(chunk_start + chunk_len, whole_end)
        if BLOCK_SIZE >= BLOCK_N and PAGE_CHUNK > 0:
            tile_starts = chunk_start + tile_ids * BLOCK_N  # [PAGE_CHUNK]
            chunk_pages = tl.load(bt_row + tile_starts // BLOCK_SIZE, mask=tile_starts < chunk_end,
                                  other=0)
        elif BLOCK_N % BLOCK_SIZE == 0 and PAGE_CHUNK > 0:
            # Small pages, PAGES_PER_TILE whole pages per tile: the chunk's page ids as
            # [PAGE_CHUNK, PAGES_PER_TILE], read before the tile loop like one id per tile.
            page_starts = chunk_start + (tile_ids[:, None] * BLOCK_N
                                         + page_slots[None, :] * BLOCK_SIZE)
            chunk_pages = tl.load(bt_row + page_starts // BLOCK_SIZE,
                                  mask=page_starts < chunk_end, other=0)
        for start in tl.range(chunk_start, chunk_end, BLOCK_N, num_stages=NUM_STAGES):
            pos = start + offs_n  # [BLOCK_N] key positions
            key_mask = pos < split_end
            if BLOCK_SIZE >= BLOCK_N:
                # Splits start on tile boundaries, so the whole tile lies in one page.
                if PAGE_CHUNK > 0:
                    tile = (start - chunk_start) // BLOCK_N
                    page = tl.sum(tl.where(tile_ids == tile, chunk_pages, 0), axis=0)
                else:
                    page = tl.load(bt_row + start // BLOCK_SIZE)
                page = page.to(tl.int64)
                kv_offs = page * stride_kv_block + (start % BLOCK_SIZE + offs_n) * stride_kv_slot
            elif BLOCK_N % BLOCK_SIZE == 0 and PAGE_CHUNK > 0:
                # Row n of the tile lies in the tile's page n // BLOCK_SIZE: pick the tile's
                # [PAGES_PER_TILE] ids from the chunk, then each row's id from those.
                tile = (start - chunk_start) // BLOCK_N
                tile_pages = tl.sum(tl.where((tile_ids == tile)[:, None], chunk_pages, 0), axis=0)
                row_page = offs_n // BLOCK_SIZE  # [BLOCK_N]
                page = tl.sum(tl.where(row_page[:, None] == page_slots[None, :],
                                       tile_pages[None, :], 0), axis=1).to(tl.int64)
                kv_offs = page * stride_kv_block + (offs_n % BLOCK_SIZE) * stride_kv_slot
            else:
                page = tl.load(bt_row + pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
                kv_offs = page * stride_kv_block + (pos % BLOCK_SIZE) * stride_kv_slot
            if USE_TMA:
                row = (page * BLOCK_SIZE + start % BLOCK_SIZE).to(tl.int32)  # cache row
                if LATENT_CHUNKS == 1:
                    k_nope = kv_nope_desc.load([row, 0])  # [BLOCK_N, L], also V
                else:
                    k_nope = kv_nope_desc.load([row, 0, 0])  # [BLOCK_N, C, L / C]
                k_pe = kv_pe_desc.load([row, 0])  # [BLOCK_N, R]
            else:
                k_nope, k_pe = _masked_tile(kv_ptr, kv_offs, key_mask, KV_LORA_RANK, ROPE_DIM,
                                            LATENT_CHUNKS)
            acc, m_i, l_i = _attend(q_nope, q_pe, k_nope, k_pe, pos, key_mask, last_key,
                                    qk_scale, acc, m_i, l_i, DOT_PRECISION, LATENT_CHUNKS)
    if USE_TMA and whole_end < split_end:
        # The split's partial last tile: masked pointer loads (zeros past the length, where
        # the page tail may hold NaN; a TMA box would bring those rows into the dots).
        pos = whole_end + offs_n
        key_mask = pos < split_end
        page = tl.load(bt_row + whole_end // BLOCK_SIZE).to(tl.int64)
        kv_offs = page * stride_kv_block + (whole_end % BLOCK_SIZE + offs_n) * stride_kv_slot
        k_nope, k_pe = _masked_tile(kv_ptr, kv_offs, key_mask, KV_LORA_RANK, ROPE_DIM,
                                    LATENT_CHUNKS)
        acc, m_i, l_i = _attend(q_nope, q_pe, k_nope, k_pe, pos, key_mask, last_key,
                                qk_scale, acc, m_i, l_i, DOT_PRECISION, LATENT_CHUNKS)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # natural log; -inf where no key
    base = req.to(tl.int64) * num_splits + split  # (request, split) index
    if DIRECT_OUTPUT:
        o_mask = row_mask
    else:
        o_mask = row_mask & (l_i > 0.0)  # the merge never reads an empty split's output
    o_rows = (base * num_rows + rows) * KV_LORA_RANK  # [BLOCK_M]
    if LATENT_CHUNKS == 1:
        tl.store(o_ptr + o_rows[:, None] + latent_cols[None, :],
                 (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty), mask=o_mask[:, None])
    else:
        tl.store(o_ptr + o_rows[None, :, None] + latent_cols[:, None, :],
                 (acc / l_safe[None, :, None]).to(o_ptr.dtype.element_ty),
                 mask=o_mask[None, :, None])
    tl.store(lse_ptr + base * num_rows + rows, lse, mask=row_mask)


def kv_descriptors(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int,
                   latent_chunks: int = 1) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the cache's [c_kv] and [k_pe] columns over all its rows: c_kv as
    [num_blocks * block_size, L] with boxes of one tile [block_n, L], or with latent_chunks
    C > 1 as [.., C, L / C] with boxes [block_n, C, L / C]; k_pe as [.., R], boxes [block_n,
    R]. The cache's pages must lie back to back."""
    num_blocks, block_size, head_dim = kv_cache.shape
    rows, row_stride = num_blocks * block_size, kv_cache.stride(1)
    if latent_chunks == 1:
        nope = TensorDescriptor(kv_cache, [rows, kv_lora_rank], [row_stride, 1],
                                [block_n, kv_lora_rank])
    else:
        chunk = kv_lora_rank // latent_chunks
        nope = TensorDescriptor(kv_cache, [rows, latent_chunks, chunk], [row_stride, chunk, 1],
                                [block_n, latent_chunks, chunk])
    pe = TensorDescriptor(kv_cache[..., kv_lora_rank:], [rows, head_dim - kv_lora_rank],
                          [row_stride, 1], [block_n, head_dim - kv_lora_rank])
    return nope, pe


def launch_split_pass(plan: MLADecodePlan, io: SplitPassIO) -> None:
    """Stage 1 (`_mla_decode_split_kernel`) with the plan's configuration: any CUDA GPU, or
    the CPU under the interpreter; the cache's pages back to back where `plan.tma_loads`
    (`SplitPassIO` has the shapes)."""
    q, kv_cache, kv_lora_rank = io.q, io.kv_cache, io.kv_lora_rank
    config, num_splits = plan.config, plan.num_splits
    num_heads, head_dim = q.shape[1:]
    batch = io.block_table.shape[0]
    nope_desc = pe_desc = None
    if plan.tma_loads:
        nope_desc, pe_desc = kv_descriptors(kv_cache, kv_lora_rank, config.block_n,
                                            config.latent_chunks)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _mla_decode_split_kernel[(plan.num_head_groups, num_splits, batch)](
        q, kv_cache, nope_desc, pe_desc, io.block_table, io.seq_lens, io.partial_o,
        io.partial_lse, io.qk_scale, io.q_len, num_heads, num_splits, config.min_split_len,
        io.split_len, q.stride(0), q.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), io.block_table.stride(0), KV_LORA_RANK=kv_lora_rank,
        ROPE_DIM=head_dim - kv_lora_rank,
        BLOCK_SIZE=kv_cache.shape[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        NUM_STAGES=config.num_stages, PAGE_CHUNK=plan.page_chunk,
        DOT_PRECISION=precision, DIRECT_OUTPUT=num_splits == 1,
        USE_PDL=plan.programmatic_launch, USE_TMA=plan.tma_loads, FP16_DOTS=plan.fp16_dots,
        BALANCED=plan.split_slots > 0, LATENT_CHUNKS=config.latent_chunks,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


__all__ = ["kv_descriptors", "launch_split_pass"]
