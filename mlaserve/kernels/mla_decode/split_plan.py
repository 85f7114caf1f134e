"""Balanced splits: the step's split length, planned on the device from the actual lengths.

Under CUDA graphs the host plans a decode step for the longest request its graph's block table
can hold, and the split count it picks for that bound is far from what the batch needs: a
batch of short requests is cut into many tiny splits, a ragged batch's longest requests set the
makespan. With `MLADecodeConfig.balanced_splits` the plan's grid only bounds the splits
(`MLADecodePlan.num_splits`), and this kernel, launched once a step before the layers run
(`launch.plan_split_len`), picks the split length L every split pass then uses as its floor
(`splits.split_bounds`' balanced_len): request b of N_b keys is cut into ceil(N_b / L_b)
splits of L_b = max(L, round_up(ceil(N_b / S), tile)) keys (S: the grid's splits).

The choice is the host plan's waves model (`plan._choose_num_splits`) over the real lengths:
for candidate counts s = 1, 1, 2, 2, 4, 5, 8, 11, ... (about sqrt(2) apart, up to S) it sets
L = round_up(max(min_split_len, ceil(N / (B' s))), tile) (N the batch's keys, B' its requests
with keys), counts the programs P = sum_b ceil(N_b / L_b) and the longest program's keys M =
max_b min(N_b, L_b), and takes the L of least ceil(P G / slots) x (M + overhead) (G head groups
per split, slots programs running at once, overhead a split's cost in keys: its partial
output's write and re-read), the fewest splits among equals. Any L is correct (the splits still
cover every key); the model only decides the speed.
"""

import triton
import triton.language as tl

NUM_CANDIDATES = 15  # s = floor(2^(i / 2)) for i < 15: 1 .. 128


@triton.jit
def _split_len_kernel(
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [1] int32: the split length L
    batch,
    num_splits,  # S: the grid's splits per request
    num_head_groups,  # G
    slots,  # programs that run at once
    overhead,  # a split's cost, in keys
    min_split_len,  # a multiple of TILE
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,  # a power of two >= B
    NUM_CANDIDATES: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    lens = tl.load(seq_lens_ptr + offs, mask=offs < batch, other=0)  # [BLOCK]
    total = tl.sum(lens)
    busy = tl.maximum(tl.sum((lens > 0).to(tl.int32)), 1)
    # each request's split length from the grid alone: round_up(ceil(N_b / S), TILE)
    own = tl.cdiv(tl.cdiv(lens, num_splits), TILE) * TILE
    best_len = tl.full([], 0, tl.int32) + min_split_len
    best_cost = tl.full([], float("inf"), tl.float32)
    for i in tl.static_range(NUM_CANDIDATES):
        s = tl.full([], 1 << (i // 2), tl.int32)
        if i % 2 == 1:
            s = s * 14142 // 10000  # floor(2^(i / 2)), i odd
        s = tl.minimum(s, num_splits)
        split_len = tl.maximum(tl.cdiv(tl.cdiv(total, busy * s), TILE) * TILE, min_split_len)
        per = tl.maximum(own, split_len)  # [BLOCK]
        programs = tl.sum(tl.cdiv(lens, per))
        longest = tl.max(tl.minimum(lens, per))
        waves = tl.cdiv(programs * num_head_groups, slots)
        cost = (waves * (longest + overhead)).to(tl.float32)
        better = cost < best_cost
        best_len = tl.where(better, split_len, best_len)
        best_cost = tl.where(better, cost, best_cost)
    tl.store(out_ptr, best_len)


def launch_split_len(seq_lens, out, num_splits: int, num_head_groups: int, slots: int,
                     overhead: int, min_split_len: int, tile: int) -> None:
    """Write the step's split length into `out` ([1] int32) from seq_lens ([B] int32); one
    program, no synchronisation (the module docstring has the model)."""
    batch = seq_lens.shape[0]
    _split_len_kernel[(1,)](
        seq_lens, out, batch, num_splits, num_head_groups, slots, overhead, min_split_len,
        TILE=tile, BLOCK=max(16, triton.next_power_of_2(batch)),
        NUM_CANDIDATES=NUM_CANDIDATES, num_warps=4)


def compile_for_sm90(tile: int = 32, block: int = 256):
    """The kernel compiled for sm_90 without a GPU (Triton's bundled ptxas): Triton's
    CompiledKernel, for checks in CPU tests."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"seq_lens_ptr": "*i32", "out_ptr": "*i32", "batch": "i32", "num_splits": "i32",
                 "num_head_groups": "i32", "slots": "i32", "overhead": "i32",
                 "min_split_len": "i32", "TILE": "constexpr", "BLOCK": "constexpr",
                 "NUM_CANDIDATES": "constexpr"}
    constexprs = {"TILE": tile, "BLOCK": block, "NUM_CANDIDATES": NUM_CANDIDATES}
    return triton.compile(ASTSource(_split_len_kernel, signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


__all__ = ["NUM_CANDIDATES", "compile_for_sm90", "launch_split_len"]
