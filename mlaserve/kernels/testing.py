"""The one verification harness of the decode kernels, shared by the tests, `mlaserve bench
kernel` and its sweeps (docs/architecture.md, "Tests and benchmarks").

- `poisoned_paged_batch`: a random paged batch built to catch kernels that read what they must
  not (NaN in every page no request owns and in the tail of each last page, shuffled pages,
  stale block-table entries).
- `compare` / `assert_matches_reference`: one comparator against the float32 reference
  (`reference.mla_decode_reference`), with one tolerance set per dtype (`TOLERANCES`).
- `graph_replay_seconds`, `eager_seconds`, `cpu_seconds`: timers (CUDA-graph replay, the
  default for kernels); `measure_ceilings`: the device's copy and matmul rates, measured in the
  same run, from which a kernel's floor is computed; `l2_cold_copies` and `rotating`: calls
  that read different copies of their data, so that L2 holds none of what a call reads.
"""

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mlaserve.kernels.fp8_blocks import saturating_cast

DEFAULT_L2_BYTES = 60 * 1024 * 1024  # H100 / H200, where the device does not say

# ---------------------------------------------------------------------------------------------
# Inputs


def poisoned_paged_batch(
    seq_lens: list[int],
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    block_size: int,
    q_len: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_pages: int = 3,
    device: torch.device | str = "cpu",
    padding_columns: int = 1,
    draw_on_device: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random paged decode batch built to catch kernels that read what they must not.

    Pages are a random permutation of the pool; every spare page and the tail of each request's
    last page hold NaN; the block table has `padding_columns` columns past the longest request,
    and its entries past a request's pages point at (NaN) spare pages, as stale entries would.
    Random values are drawn on the CPU (the same batch on every device for a seed), or with
    draw_on_device on `device` directly, in `dtype` (for benchmark-sized caches).
    kv_cache_dtype (torch.float8_e4m3fn; None or `dtype`: no change) stores the cache in FP8 as
    the engine does (`fp8_blocks.saturating_cast`; NaN stays NaN); the float32 reference
    then dequantizes that same cache.

    Returns:
        q [B * q_len, H, L + R] in `dtype` and kv_cache [num_blocks, block_size, L + R] in
        kv_cache_dtype or `dtype`,
        block_table [B, max_blocks] int32 and seq_lens [B] int32, all on `device`.
    """
    where = torch.device(device) if draw_on_device else torch.device("cpu")
    draw_dtype = dtype if draw_on_device else torch.float32
    gen = torch.Generator(device=where).manual_seed(seed)
    head_dim = kv_lora_rank + rope_dim
    pages = [-(-n // block_size) for n in seq_lens]
    width = max(max(pages, default=0) + padding_columns, 1)
    num_used = sum(pages)
    order = torch.randperm(num_used + spare_pages, generator=gen, device=where)
    spare = order[num_used:]
    table = spare[torch.randint(spare_pages, (len(seq_lens), width), generator=gen,
                                device=where)]  # [B, width]: stale entries, NaN pages
    cache = torch.randn(num_used + spare_pages, block_size, head_dim, generator=gen,
                        device=where, dtype=draw_dtype).to(dtype)
    cache[spare] = float("nan")
    start = 0
    for b, (n, p) in enumerate(zip(seq_lens, pages, strict=True)):
        table[b, :p] = order[start : start + p]
        start += p
        if n % block_size:
            cache[table[b, p - 1], n % block_size :] = float("nan")
    if kv_cache_dtype is not None:
        cache = saturating_cast(cache, kv_cache_dtype)
    q = torch.randn(len(seq_lens) * q_len, num_heads, head_dim, generator=gen, device=where,
                    dtype=draw_dtype).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q.to(device), cache.to(device), table.to(torch.int32).to(device), lens.to(device)


# ---------------------------------------------------------------------------------------------
# The comparator


@dataclass(frozen=True)
class Tolerance:
    """Bounds of one dtype against the float32 reference.

    atol, rtol: per element, |o - ref| <= atol + rtol * |ref|.
    rel_err: ||o - ref|| / ||ref|| over the whole output (Frobenius).
    cos_gap: 1 - the least per-row cosine similarity of o and ref over rows [L] with keys; the
        tight bound: dropping one key of an N-key row costs about 1 / (2N), so at 5e-6 a row of
        up to ~100k keys cannot lose one (FlashMLA's tests hold the same order).
    lse_err: max |lse - ref_lse| (natural log) over rows with keys.
    """

    atol: float
    rtol: float
    rel_err: float
    cos_gap: float
    lse_err: float


TOLERANCES = {
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2, rel_err=8e-3, cos_gap=5e-6, lse_err=1e-2),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3, rel_err=2e-3, cos_gap=1e-6, lse_err=1e-2),
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5, rel_err=1e-5, cos_gap=1e-8, lse_err=1e-4),
}


@dataclass
class Comparison:
    """Whether an output passed, its error metrics, and why it failed ("" when it passed)."""

    passed: bool
    metrics: dict[str, float]
    message: str = ""


def compare(o: torch.Tensor, lse: torch.Tensor | None, ref_o: torch.Tensor,
            ref_lse: torch.Tensor, dtype: torch.dtype | None = None) -> Comparison:
    """Compare a kernel's o [T, H, L] (and lse [T, H], natural log, float32) with the float32
    reference (ref_o [T, H, L], ref_lse [T, H], from `mla_decode_reference`).

    Checks: o has ref's shape and the input dtype (`dtype`, default o's); o is finite; rows
    with no key (ref_lse = -inf) are exactly 0 with lse -inf, and only those; per element
    atol/rtol, relative error and the least per-row cosine within `TOLERANCES[dtype]`; lse
    within lse_err. `lse` None (a kernel that returns none) checks o alone.
    """
    dtype = o.dtype if dtype is None else dtype
    if tuple(o.shape) != tuple(ref_o.shape):
        return Comparison(False, {}, f"output shape {tuple(o.shape)} != {tuple(ref_o.shape)}")
    if o.dtype != dtype:
        return Comparison(False, {}, f"output dtype {o.dtype} != {dtype}")
    tol = TOLERANCES[dtype]
    # float64: a float32 cosine cannot resolve 1 - cos below ~1e-7
    out, ref_o, ref_lse = o.double(), ref_o.double().to(o.device), ref_lse.to(o.device)
    if not bool(torch.isfinite(out).all()):
        return Comparison(False, {}, "non-finite values in the output (NaN pages read?)")
    rows, ref_rows = out.flatten(0, 1), ref_o.flatten(0, 1)  # [T * H, L]
    has_keys = ~torch.isneginf(ref_lse).flatten()  # [T * H]
    rel_err = relative_error(out, ref_o)
    excess = (out - ref_o).abs() - tol.rtol * ref_o.abs()  # [T, H, L]
    max_excess = float(excess.max()) if excess.numel() else 0.0
    cos = (rows * ref_rows).sum(-1) / (rows.norm(dim=-1) * ref_rows.norm(dim=-1)).clamp_min(
        1e-30)  # [T * H]
    cos_gap = float(1 - cos[has_keys].min()) if bool(has_keys.any()) else 0.0
    stray = float(rows[~has_keys].abs().max()) if bool((~has_keys).any()) else 0.0
    metrics = {"rel_err": rel_err, "cos_gap": cos_gap}
    problems = []
    if max_excess > tol.atol:
        problems.append(f"|o - ref| exceeds {tol.atol:.0e} + {tol.rtol:.0e} |ref| by "
                        f"{max_excess - tol.atol:.2e}")
    if rel_err > tol.rel_err:
        problems.append(f"rel_err {rel_err:.2e} > {tol.rel_err:.0e}")
    if cos_gap > tol.cos_gap:
        problems.append(f"1 - min cos {cos_gap:.2e} > {tol.cos_gap:.0e}")
    if stray > 0:
        problems.append(f"rows with no keys are not 0 (max |o| {stray:.2e})")
    if lse is not None:
        problems += _lse_problems(lse, ref_lse, tol, metrics)
    return Comparison(not problems, metrics, "; ".join(problems))


def _lse_problems(lse: torch.Tensor, ref_lse: torch.Tensor, tol: Tolerance,
                  metrics: dict[str, float]) -> list[str]:
    """What is wrong with lse [T, H] against ref_lse [T, H]; records metrics["lse_err"]."""
    if tuple(lse.shape) != tuple(ref_lse.shape) or lse.dtype != torch.float32:
        return [f"lse {tuple(lse.shape)} {lse.dtype} != {tuple(ref_lse.shape)} float32"]
    empty = torch.isneginf(ref_lse)
    if bool(torch.isnan(lse).any()) or not bool((torch.isneginf(lse) == empty).all()):
        return ["lse is NaN, or -inf where the reference is not (or not where it is)"]
    lse_err = float((lse.double() - ref_lse.double())[~empty].abs().max()) \
        if bool((~empty).any()) else 0.0
    metrics["lse_err"] = lse_err
    if lse_err > tol.lse_err:
        return [f"lse error {lse_err:.2e} > {tol.lse_err:.0e} (natural log expected)"]
    return []


def assert_matches_reference(o: torch.Tensor, lse: torch.Tensor | None, ref_o: torch.Tensor,
                             ref_lse: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """`compare`, raising AssertionError with the problems and metrics when it fails."""
    result = compare(o, lse, ref_o, ref_lse, dtype)
    assert result.passed, f"{result.message} ({result.metrics})"


# ---------------------------------------------------------------------------------------------
# Timers and ceilings


@dataclass(frozen=True)
class Ceilings:
    """Device rates measured in this run: copy bytes (read + written) and matmul flops per s."""

    copy_bytes_per_s: float
    matmul_flops_per_s: float


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius, in float32 or the inputs' wider type; 0 / 0
    counts as 0)."""
    dtype = torch.promote_types(torch.promote_types(got.dtype, want.dtype), torch.float32)
    got, want = got.to(dtype), want.to(dtype)
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def event_seconds(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() over `repeats` calls, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _copy_seconds(device: torch.device, num_bytes: int, repeats: int) -> float:
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return event_seconds(lambda: dst.copy_(src), repeats)


def _matmul_seconds(device: torch.device, n: int, repeats: int) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return event_seconds(lambda: torch.mm(a, b), repeats)


def measure_ceilings(device: torch.device, copy_bytes: int = 1 << 30, matmul_n: int = 8192,
                     repeats: int = 10) -> Ceilings:
    """A device-to-device copy of copy_bytes (read + write) and a bfloat16 matmul_n^3 torch.mm
    on random data, medians of CUDA-event timings."""
    copy_s = _copy_seconds(device, copy_bytes, repeats)
    matmul_s = _matmul_seconds(device, matmul_n, repeats)
    torch.cuda.empty_cache()
    return Ceilings(2 * copy_bytes / copy_s, 2 * matmul_n**3 / matmul_s)


def l2_bytes(device: torch.device) -> int:
    """The device's L2 size (DEFAULT_L2_BYTES when unknown)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def l2_cold_copies(tensor: torch.Tensor) -> list[torch.Tensor]:
    """`tensor` (on a GPU) and identical copies, enough that a rotation over them reads twice
    the L2 between two reads of one copy, as a model reads each layer's own weights (at most
    what fits in half the free memory)."""
    size = tensor.numel() * tensor.element_size()
    wanted = math.ceil(2 * l2_bytes(tensor.device) / size) + 1
    free, _ = torch.cuda.mem_get_info(tensor.device)
    count = max(1, min(wanted, int(0.5 * free) // size))
    return [tensor] + [tensor.clone() for _ in range(count - 1)]


def rotating(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs `calls` in turn (e.g. one per KV copy, so L2 is not measured)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def cpu_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds per call (time.perf_counter), after one warm-up call."""
    call()
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def eager_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median seconds per eager call on CUDA: triton.testing.do_bench (L2 flushed between
    calls), or CUDA events around each call when Triton is missing."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return event_seconds(call, max(repeats, 1) * 5)
    return do_bench(call, warmup=25, rep=100, return_mode="median") / 1e3


def graph_replay_seconds(calls: Sequence[Callable[[], object]], repeats: int,
                         check: Callable[[object], None] | None = None,
                         calls_per_graph: int = 16, warmup_rounds: int = 2,
                         after_capture: Callable[[], None] | None = None) -> float:
    """Median seconds per call under CUDA-graph replay.

    Graphs of `calls_per_graph` calls are captured, cycling through `calls`, until every call
    is in one; a round replays them all between two CUDA events; the result is the median round
    over `repeats` rounds, per call. The first call runs once eagerly on a side stream first
    (compiles, initialises). `after_capture` runs between capture and the first replay (e.g.
    a backend's `plan_for_replay`). `check` gets the replayed output of the first captured call
    after one round, before any timing, and raises if it is wrong.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls[0]()
    torch.cuda.current_stream().wait_stream(side)
    num_graphs = math.ceil(len(calls) / calls_per_graph)
    order = [calls[i % len(calls)] for i in range(num_graphs * calls_per_graph)]
    graphs, first_output = [], None
    for g in range(num_graphs):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = [call() for call in order[g * calls_per_graph:(g + 1) * calls_per_graph]]
        graphs.append(graph)
        if g == 0:
            first_output = outputs[0]

    if after_capture is not None:
        after_capture()

    def round_() -> None:
        for graph in graphs:
            graph.replay()

    round_()
    torch.cuda.synchronize()
    if check is not None:
        check(first_output)
    return event_seconds(round_, repeats, warmup=warmup_rounds) / (num_graphs * calls_per_graph)


__all__ = ["TOLERANCES", "Ceilings", "Comparison", "Tolerance", "assert_matches_reference",
           "compare", "cpu_seconds", "eager_seconds", "event_seconds", "graph_replay_seconds",
           "measure_ceilings", "poisoned_paged_batch", "rotating"]
