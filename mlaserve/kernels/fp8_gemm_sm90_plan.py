"""How the sm_90 block-FP8 GEMM (`fp8_gemm_sm90`) cuts a product into work, decided on the host
without importing Gluon: the tile width, K split into runs, the tiles shared by stream-K, and
where `fp8_gemm.product_path` takes this kernel rather than cuBLASLt.

The kernel is persistent: one CTA per SM visits the tiles (128 x BLOCK_N) in turn, so a product
takes as many rounds as the busiest CTA has tiles, and a last round of a few tiles costs a whole
round's time. Three cuts keep the SMs busy:
- 64-wide tiles where 128-wide ones leave most SMs idle and no balancing below applies (a 64-wide
  round costs `NARROW_ROUND_COST` of a wide one, not half);
- stream-K where the tiles fill more than one round but not a whole number of them: the last
  round's tiles and one round more are shared evenly by K blocks across the CTAs, each share a
  tile or more deep, so a shared tile lies in at most two CTAs' shares and one of them adds the
  other's sum (V3's q_a + kv_a at 1024 tokens: 136 tiles on 132 SMs, 57.7 K blocks each instead
  of two rounds of 56);
- K split into runs with a second launch adding their sums where the tiles fill at most half
  the SMs (V3's q_a + kv_a at 64 tokens: 33 narrow tiles).
"""

import torch

BLOCK_M = 128  # two warpgroups of 64 rows
BLOCK_NS = (128, 64)  # within one weight scale row per tile
BLOCK_K = 128  # one scale column per K block
# The time of a round of 64-wide tiles against a round of 128-wide ones, measured on the H200
# (scripts/fp8_gemm_sm90_check.py, both widths on V3's shapes: 0.73-0.83, not 0.5): a 64-wide
# wgmma reads as many x bytes as a 128-wide one for half the work, and a tile has fixed costs
NARROW_ROUND_COST = 0.8
# K is split only where the tiles fill at most half the SMs, and into runs of at least this many
# K blocks (a unit's fixed costs, and the partial sums' traffic, against its products)
MIN_SPLIT_BLOCKS = 4
# Where stream-K is on: the kernel shares a product's last round (`choose_stream_k_tiles`)
STREAM_K = True
# The Gluon product is taken over cuBLASLt's for products of more than one round where
# cuBLASLt's whole 128-wide tiles would take at least this much longer than an even share
STREAM_K_ROUTING_GAIN = 1.15
DEFAULT_STAGES = 5  # 5 x 32 KB ring + 32 KB output staging: one CTA per SM
DEFAULT_GROUP_M = 8
DEFAULT_K_UNROLL = 2  # chains of 2 beat 4 on 11 of V3's 14 cells (benchmarks/fp8/gemm_sm90.log)


def num_tiles(rows: int, out_features: int, block_n: int) -> int:
    """The product's tiles, 128 rows x block_n columns."""
    return -(-rows // BLOCK_M) * -(-out_features // block_n)


def shared_memory_bytes(num_stages: int, out_dtype: torch.dtype, block_n: int = 128) -> int:
    """The shared memory a CTA takes (an upper bound): the ring of FP8 x and W tiles, the
    output staging [2, 64, block_n] and the barriers."""
    ring = num_stages * (BLOCK_M + block_n) * BLOCK_K
    return ring + BLOCK_M * block_n * out_dtype.itemsize + 1024


def choose_block_n(rows: int, out_features: int, num_sms: int, stream_k: bool = STREAM_K
                   ) -> int:
    """128, or 64 where that is faster: a width's estimated time is its rounds times the time
    of one of its rounds (1 at 128, NARROW_ROUND_COST at 64). Its rounds are ceil(tiles /
    SMs), or with stream-K past one round tiles / SMs (the last round shared evenly)."""
    def rounds(block_n: int) -> float:
        tiles = num_tiles(rows, out_features, block_n)
        if stream_k and tiles > num_sms:
            return tiles / num_sms
        return -(-tiles // num_sms)

    return 64 if rounds(64) * NARROW_ROUND_COST < rounds(128) else 128


def choose_k_splits(rows: int, out_features: int, in_features: int, block_n: int,
                    num_sms: int) -> int:
    """Into how many runs of K blocks the product is split: 1 where its tiles (128 x block_n)
    fill more than half the SMs, else as many as fill the SMs with one unit each, at most one
    per `MIN_SPLIT_BLOCKS` K blocks (V3's q_a + kv_a, K = 7168, narrow tiles: 4 at 64 tokens,
    2 at 256)."""
    tiles = num_tiles(rows, out_features, block_n)
    if 2 * tiles > num_sms:
        return 1
    return max(1, min(num_sms // tiles, -(-in_features // BLOCK_K) // MIN_SPLIT_BLOCKS))


def choose_stream_k_tiles(rows: int, out_features: int, block_n: int, num_sms: int,
                          k_splits: int = 1, stream_k: bool = STREAM_K) -> int:
    """How many tiles (the first the CTAs visit) the CTAs share evenly by K blocks: none where
    stream-K is off, K is split, or the tiles fill one round or less or whole rounds; else the
    last round's tiles and one round more, so that each CTA's share is a tile or more deep
    and a shared tile lies in at most two shares (V3's q_a + kv_a at 1024 tokens: all 136)."""
    tiles = num_tiles(rows, out_features, block_n)
    if not stream_k or k_splits > 1 or tiles <= num_sms or tiles % num_sms == 0:
        return 0
    return tiles % num_sms + num_sms


def gluon_balances_better(rows: int, out_features: int, num_sms: int,
                          stream_k: bool = STREAM_K) -> bool:
    """Whether the Gluon product's cut of the work beats whole 128-wide tiles (as cuBLASLt's
    are) by enough to take it: where 64-wide tiles are chosen (128-wide ones leave most SMs
    idle), or with stream-K past one round where whole tiles' rounds take at least
    `STREAM_K_ROUTING_GAIN` times an even share's (V3's q_a + kv_a at 4096 tokens: 5 rounds
    against 4.12)."""
    if choose_block_n(rows, out_features, num_sms, stream_k=False) == 64:
        return True
    tiles = num_tiles(rows, out_features, 128)
    return (stream_k and tiles > num_sms
            and -(-tiles // num_sms) >= STREAM_K_ROUTING_GAIN * tiles / num_sms)


def gluon_gemm_serves(rows: int, out_features: int, in_features: int) -> bool:
    """Whether `block_fp8_matmul_sm90` takes x [rows, K] @ W [N, K]^T on an sm_90 GPU: TMA's
    16-byte rows (K a multiple of 16, N of 8 for a 16-bit y) and at least one row."""
    return rows > 0 and in_features > 0 and in_features % 16 == 0 and out_features % 8 == 0
