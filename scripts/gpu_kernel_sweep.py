#!/usr/bin/env python
"""Check, then tune, the Triton paged MLA decode kernel on one GPU (written for an H200).

Usage, from the repository root:

    python scripts/gpu_kernel_sweep.py                 # about 5 minutes on one H200
    OUT=/some/dir python scripts/gpu_kernel_sweep.py   # also writes $OUT/gpu_kernel_sweep.json
    TRITON_INTERPRET=1 python scripts/gpu_kernel_sweep.py --smoke   # tiny shapes on CPU

What it does, in order (correct before timed):
1. Ceilings: device copy bandwidth (bytes read + written) and the bf16 8192^3 matmul rate.
2. Correctness of the default configuration against the float32 `mla_decode_reference` on the
   anchor shapes: heads {16, 128} x batch {1, 64, 512} x kv {1024, 4096} (batch 1 also 8192),
   block 64 and 32, q_len 1, 2 and 4; unused block-table columns point at a NaN page.
3. Timing under CUDA-graph replay (KV copies rotated so L2 is not what is measured): first the
   default configuration on every shape, then, while the time budget lasts, a sweep per shape of
   tile configurations (head-group rows block_m, tile block_n, num_warps, num_stages) with the
   default split policy, then of split policies with the best tile. Every timed configuration is
   checked against the reference first.
4. Registers and spills of the compiled stage-1 kernels, then a compact table: µs, GB/s, TFLOP/s,
   % of the floor max(bytes / copy rate, flops / matmul rate), the best configuration, and the
   FlashInfer fa3 time measured earlier on an H200 for scale (not measured here).
The shapes and the candidate configurations are in kernel_sweep_space.py beside this file.
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_sweep_space import (  # noqa: E402  (this folder: the shapes and candidates)
    FA3_ANCHOR_US,
    Shape,
    config_name,
    correctness_shapes,
    split_candidates,
    tile_candidates,
    timing_shapes,
)

from mlaserve.bench.kernel_grid import decode_bytes, decode_flops  # noqa: E402
from mlaserve.kernels import mla_decode as kernels  # noqa: E402
from mlaserve.kernels import mla_decode_plan as planning  # noqa: E402
from mlaserve.kernels.mla_decode_plan import MLADecodeConfig  # noqa: E402
from mlaserve.kernels.reference import mla_decode_reference  # noqa: E402

L2_DEFEAT_BYTES = 240 * 2**20  # rotate KV copies until one replay touches this much


class Sweep:
    """Problem sizes, device and timing for one run (full H200 run or the CPU smoke run)."""

    def __init__(self, smoke: bool, budget_s: float) -> None:
        self.smoke = smoke
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float16 if smoke else torch.bfloat16
        self.kv_lora_rank, self.rope_dim = (64, 16) if smoke else (512, 64)
        self.head_dim = self.kv_lora_rank + self.rope_dim
        self.softmax_scale = 1 / math.sqrt(192)
        self.num_sms = 4 if smoke else torch.cuda.get_device_properties(0).multi_processor_count
        self.skipped: list[str] = []
        self._problem: tuple | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    # ---- problems ----
    def make_cache(self, shape: Shape, num_copies: int, seed: int
                   ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """KV copies [num_pages, block_size, L + R], a shuffled block table, uniform lengths.

        The block table has one extra column pointing at a NaN page (never to be read).
        """
        torch.manual_seed(seed)
        pages_per_seq = -(-shape.kv_len // shape.block_size)
        num_pages = shape.batch * pages_per_seq + 1
        caches = []
        for _ in range(num_copies):
            cache = torch.randn(num_pages, shape.block_size, self.head_dim, device=self.device,
                                dtype=self.dtype)
            cache[-1] = float("nan")
            caches.append(cache)
        perm = torch.randperm(num_pages - 1, device=self.device)
        table = perm.view(shape.batch, pages_per_seq)  # [B, pages_per_seq]
        pad = torch.full((shape.batch, 1), num_pages - 1, device=self.device)
        block_table = torch.cat([table, pad], dim=1).to(torch.int32)  # [B, pages_per_seq + 1]
        seq_lens = torch.full((shape.batch,), shape.kv_len, dtype=torch.int32, device=self.device)
        return caches, block_table, seq_lens

    def make_q(self, shape: Shape) -> torch.Tensor:
        return torch.randn(shape.batch * shape.q_len, shape.num_heads, self.head_dim,
                           device=self.device, dtype=self.dtype)  # [B * q_len, H, L + R]

    def plan(self, shape: Shape, config: MLADecodeConfig | None) -> planning.MLADecodePlan:
        return planning.plan_mla_decode(
            shape.batch, (-(-shape.kv_len // shape.block_size) + 1) * shape.block_size,
            shape.num_heads, shape.q_len, self.kv_lora_rank, self.rope_dim, self.dtype,
            self.num_sms, config=config, block_size=shape.block_size)

    def launcher(self, plan: planning.MLADecodePlan, q: torch.Tensor, cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int,
                 workspace: tuple[torch.Tensor, torch.Tensor]
                 ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def call() -> tuple[torch.Tensor, torch.Tensor]:
            return kernels.mla_decode_triton(
                q, cache, block_table, seq_lens, self.softmax_scale, self.kv_lora_rank, q_len,
                plan, workspace=workspace)

        return call

    def timing_problem(self, shape: Shape) -> tuple:
        """(KV copies, block table, lengths, q, reference o, reference lse) for timing a shape.

        The last one is kept, so the tile and split sweeps of a shape share it.
        """
        if self._problem is not None and self._problem[0] == shape:
            return self._problem[1]
        self._problem = None  # free the previous shape's copies first
        moved = decode_bytes(shape.cell, self.kv_lora_rank, self.rope_dim)
        num_copies = 1 if self.smoke else max(1, min(128, -(-L2_DEFEAT_BYTES // moved)))
        caches, block_table, seq_lens = self.make_cache(shape, num_copies, seed=7)
        q = self.make_q(shape)
        ref_o, ref_lse = mla_decode_reference(q, caches[0], block_table, seq_lens,
                                              self.softmax_scale, self.kv_lora_rank, shape.q_len)
        self._problem = (shape, (caches, block_table, seq_lens, q, ref_o, ref_lse))
        return self._problem[1]

    # ---- checks and timing ----
    @staticmethod
    def compare(o: torch.Tensor, lse: torch.Tensor, ref_o: torch.Tensor,
                ref_lse: torch.Tensor) -> dict:
        """Relative Frobenius error, least per-row cosine, max LSE error; `ok` if all within."""
        o = o.float()
        finite = torch.isfinite(ref_lse)
        rel = ((o - ref_o).norm() / ref_o.norm().clamp_min(1e-30)).item()
        cosine = torch.nn.functional.cosine_similarity(o[finite], ref_o[finite], dim=-1)
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
        ok = (not o.isnan().any().item() and torch.equal(torch.isfinite(lse), finite)
              and rel < 1e-2 and cosine.min().item() > 0.9995 and lse_err < 1e-2)
        return {"ok": bool(ok), "rel_err": rel, "min_cos": cosine.min().item(),
                "lse_err": lse_err}

    def time_us(self, calls: list[Callable[[], object]]) -> float:
        """µs per call: all calls captured in one CUDA graph, median over replays."""
        if self.smoke:
            begin = time.perf_counter()
            for call in calls:
                call()
            return (time.perf_counter() - begin) * 1e6 / len(calls)
        # Initialise (cuBLAS handles, first launches) outside the capture, on a side stream.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            calls[0]()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        once_ms = start.elapsed_time(end)
        samples = []
        for _ in range(max(3, min(30, int(40 / max(once_ms, 1e-3))))):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        del graph
        return statistics.median(samples) * 1000 / len(calls)

    def ceilings(self) -> tuple[float, float]:
        """(copy GB/s counting read + write, bf16 matmul TFLOP/s)."""
        if self.smoke:
            return 4000.0, 600.0
        src = torch.empty(2**29, dtype=torch.bfloat16, device=self.device)  # 1 GiB
        dst = torch.empty_like(src)
        copy_us = self.time_us([lambda: dst.copy_(src)] * 4)
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=self.device)
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=self.device)
        c = torch.empty_like(a)
        mm_us = self.time_us([lambda: torch.mm(a, b, out=c)] * 4)
        return 2 * 2**30 / copy_us / 1e3, 2 * 8192**3 / mm_us / 1e6

    def roofline(self, shape: Shape, us: float, copy_gbs: float, mm_tflops: float) -> dict:
        moved = decode_bytes(shape.cell, self.kv_lora_rank, self.rope_dim)
        flops = decode_flops(shape.cell, self.kv_lora_rank, self.rope_dim)
        floor_us = max(moved / copy_gbs / 1e3, flops / mm_tflops / 1e6)
        return {"us": us, "gbs": moved / us / 1e3, "tflops": flops / us / 1e6,
                "floor_us": floor_us, "pct_floor": 100 * floor_us / us}


def compiled_split_kernels() -> list[dict]:
    """n_regs / n_spills / shared memory / wgmma of every compiled stage-1 kernel so far."""
    jit = kernels._mla_decode_split_kernel
    rows = []
    for caches in getattr(jit, "device_caches", {}).values():
        for kernel in list(caches[0].values()):
            try:
                if hasattr(kernel, "result"):
                    kernel = kernel.result()
                kernel._init_handles()
                consts = {jit.arg_names[k[0]]: v for k, v in kernel.src.constants.items()}
                ptx = kernel.asm.get("ptx", "")
                rows.append({
                    "block_m": consts.get("BLOCK_M"), "block_n": consts.get("BLOCK_N"),
                    "block_size": consts.get("BLOCK_SIZE"),
                    "direct_output": bool(consts.get("DIRECT_OUTPUT")),
                    "num_warps": kernel.metadata.num_warps,
                    "num_stages": kernel.metadata.num_stages,
                    "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                    "shared_bytes": kernel.metadata.shared,
                    "wgmma": "wgmma" in ptx, "cp_async": "cp.async" in ptx,
                })
            except Exception as exc:  # report what is there; never fail the run on it
                rows.append({"error": repr(exc)})
    return rows


def run_correctness(sweep: Sweep) -> list[dict]:
    results = []
    shapes = correctness_shapes(sweep.smoke)
    cells = sorted({(s.block_size, s.batch, s.kv_len) for s in shapes})
    for block_size, batch, kv_len in cells:
        caches = block_table = seq_lens = None
        for shape in [s for s in shapes if (s.block_size, s.batch, s.kv_len)
                      == (block_size, batch, kv_len)]:
            if caches is None:
                caches, block_table, seq_lens = sweep.make_cache(shape, 1, seed=kv_len + batch)
            q = sweep.make_q(shape)
            plan = sweep.plan(shape, None)
            workspace = planning.alloc_workspace(plan, sweep.device)
            entry = {"shape": dataclasses.asdict(shape), "num_splits": plan.num_splits,
                     "config": dataclasses.asdict(plan.config)}
            try:
                o, lse = sweep.launcher(plan, q, caches[0], block_table, seq_lens, shape.q_len,
                                        workspace)()
                ref_o, ref_lse = mla_decode_reference(q, caches[0], block_table, seq_lens,
                                                      sweep.softmax_scale, sweep.kv_lora_rank,
                                                      shape.q_len)
                entry |= sweep.compare(o, lse, ref_o, ref_lse)
                del o, lse, ref_o, ref_lse
            except Exception as exc:
                entry |= {"ok": False, "error": repr(exc)}
            results.append(entry)
            mark = "ok " if entry["ok"] else "BAD"
            detail = entry.get("error") or (f"rel {entry['rel_err']:.1e} cos "
                                            f"{entry['min_cos']:.6f} lse {entry['lse_err']:.1e}")
            print(f"  {mark} {shape!s:<28} splits {plan.num_splits:<3} {detail}", flush=True)
        del caches
    return results


def time_shape(sweep: Sweep, shape: Shape, configs: list[MLADecodeConfig | None],
               fixed_splits: list[int | None] | None = None) -> list[dict]:
    """Check then time each configuration on one shape; KV copies rotated across calls."""
    caches, block_table, seq_lens, q, ref_o, ref_lse = sweep.timing_problem(shape)
    num_copies = len(caches)
    fixed_splits = fixed_splits or [None] * len(configs)
    results = []
    for config, splits in zip(configs, fixed_splits, strict=True):
        if results and sweep.over_budget():
            sweep.skipped.append(f"{shape}: {len(configs) - len(results)} configurations")
            break
        plan = sweep.plan(shape, config)
        if splits is not None:
            plan = dataclasses.replace(plan, num_splits=splits)
        workspace = planning.alloc_workspace(
            planning.plan_mla_decode(shape.batch, 0, shape.num_heads, shape.q_len,
                                    sweep.kv_lora_rank, sweep.rope_dim, sweep.dtype, 1,
                                    config=plan.config, num_splits=plan.num_splits),
            sweep.device)
        entry = {"shape": dataclasses.asdict(shape), "config": dataclasses.asdict(plan.config),
                 "num_splits": plan.num_splits, "name": config_name(plan.config, plan.num_splits)}
        try:
            calls = [sweep.launcher(plan, q, caches[i % num_copies], block_table, seq_lens,
                                    shape.q_len, workspace)
                     for i in range(max(16, num_copies))]
            o, lse = calls[0]()  # compiles; checked before it is timed
            check = sweep.compare(o, lse, ref_o, ref_lse)
            del o, lse
            entry |= check
            if check["ok"]:
                entry["us"] = sweep.time_us(calls)
        except Exception as exc:
            entry |= {"ok": False, "error": repr(exc).splitlines()[0][:200]}
            if not sweep.smoke:
                torch.cuda.synchronize()
        results.append(entry)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU (TRITON_INTERPRET=1) to check this script")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="stop starting new sweep measurements after this many seconds")
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from mlaserve.attention.triton_backend import patch_triton_interpreter

        patch_triton_interpreter()
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    import triton

    sweep = Sweep(args.smoke, args.budget_s)
    device_name = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(0)
    print(f"{device_name}, {sweep.num_sms} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)

    copy_gbs, mm_tflops = sweep.ceilings()
    print(f"ceilings: copy {copy_gbs:.0f} GB/s (read + write), bf16 matmul {mm_tflops:.0f} "
          f"TFLOP/s", flush=True)

    print("correctness of the default configuration vs mla_decode_reference (float32):",
          flush=True)
    correctness = run_correctness(sweep)
    num_bad = sum(not r["ok"] for r in correctness)
    print(f"correctness: {len(correctness) - num_bad}/{len(correctness)} ok "
          f"({sweep.elapsed():.0f} s)", flush=True)

    shapes = timing_shapes(args.smoke)
    timings: dict[Shape, list[dict]] = {}
    print("timing the default configuration:", flush=True)
    for shape in shapes:
        if sweep.over_budget():
            sweep.skipped.append(f"default {shape}")
            continue
        timings[shape] = time_shape(sweep, shape, [None])
        entry = timings[shape][0]
        print(f"  {shape!s:<28} {entry.get('us', float('nan')):9.1f} us  {entry['name']}"
              f"{'' if entry['ok'] else '  FAILED ' + entry.get('error', 'check')}", flush=True)

    print("sweep (tiles, then split policies with the best tile):", flush=True)
    for shape in shapes:
        if shape not in timings or sweep.over_budget():
            sweep.skipped.append(f"sweep {shape}")
            continue
        tiles = tile_candidates(sweep, shape)[1:]  # the default is timed already
        timings[shape] += time_shape(sweep, shape, tiles)
        timed = [r for r in timings[shape] if "us" in r]
        if not timed or sweep.over_budget():
            continue
        best = MLADecodeConfig(**min(timed, key=lambda r: r["us"])["config"])
        configs, policy_names = split_candidates(sweep, shape, best)
        split_results = time_shape(sweep, shape, configs)
        for entry, name in zip(split_results, policy_names, strict=True):
            entry["policies"] = name
        timings[shape] += split_results
        best_entry = min((r for r in timings[shape] if "us" in r), key=lambda r: r["us"])
        print(f"  {shape!s:<28} best {best_entry['us']:9.1f} us  {best_entry['name']} "
              f"({sweep.elapsed():.0f} s)", flush=True)
        for entry in timings[shape]:
            if not entry["ok"]:
                print(f"      failed: {entry['name']}: {entry.get('error', 'wrong result')}")

    compiled = compiled_split_kernels()
    print("compiled stage-1 kernels (registers per thread, spilled bytes, shared memory):")
    for row in sorted(compiled, key=lambda r: tuple(str(v) for v in r.values())):
        if "error" in row:
            print(f"  {row['error']}")
            continue
        print(f"  m{row['block_m']} n{row['block_n']} w{row['num_warps']} s{row['num_stages']} "
              f"blk{row['block_size']} {'direct' if row['direct_output'] else 'split '}: "
              f"regs {row['n_regs']} spills {row['n_spills']} smem {row['shared_bytes']} "
              f"wgmma {'yes' if row['wgmma'] else 'no'} cp.async "
              f"{'yes' if row['cp_async'] else 'no'}")
    if sweep.skipped:
        print(f"skipped for the {args.budget_s:.0f} s budget: {'; '.join(sweep.skipped)}")

    table = []
    for shape in shapes:
        timed = [r for r in timings.get(shape, []) if "us" in r]
        if not timed:
            continue
        default_us = timings[shape][0].get("us", float("nan"))
        best = min(timed, key=lambda r: r["us"])
        row = {"shape": dataclasses.asdict(shape), "default_us": default_us,
               "best": best["name"], "best_config": best["config"],
               "best_num_splits": best["num_splits"], "best_policies": best.get("policies"),
               "fa3_anchor_us": FA3_ANCHOR_US.get(shape.key)}
        row |= sweep.roofline(shape, best["us"], copy_gbs, mm_tflops)
        table.append(row)

    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "gpu_kernel_sweep.json"
        path.write_text(json.dumps({
            "device": device_name, "num_sms": sweep.num_sms, "torch": torch.__version__,
            "triton": triton.__version__, "copy_gbs": copy_gbs, "matmul_tflops": mm_tflops,
            "correctness": correctness,
            "timings": [r for shape in shapes for r in timings.get(shape, [])],
            "compiled": compiled, "table": table, "skipped": sweep.skipped,
            "elapsed_s": sweep.elapsed(),
        }, indent=1))
        print(f"wrote {path}")

    print(f"\ncopy {copy_gbs:.0f} GB/s, matmul {mm_tflops:.0f} TFLOP/s; correctness "
          f"{len(correctness) - num_bad}/{len(correctness)} ok; {sweep.elapsed():.0f} s")
    header = (f"{'H':>4} {'B':>4} {'kv':>6} {'blk':>3} {'q':>2} {'floor':>7} {'default':>8} "
              f"{'best':>8} {'%floor':>6} {'GB/s':>6} {'TF/s':>6} {'fa3*':>7} {'x fa3':>5}  "
              "best config")
    print(header)
    for row in table:
        s = row["shape"]
        fa3 = row["fa3_anchor_us"]
        ratio = f"{fa3 / row['us']:5.2f}" if fa3 else "    -"
        print(f"{s['num_heads']:>4} {s['batch']:>4} {s['kv_len']:>6} {s['block_size']:>3} "
              f"{s['q_len']:>2} {row['floor_us']:7.1f} {row['default_us']:8.1f} "
              f"{row['us']:8.1f} {row['pct_floor']:6.1f} {row['gbs']:6.0f} "
              f"{row['tflops']:6.1f} {fa3 or float('nan'):7.1f} {ratio}  {row['best']}"
              f"{' [' + row['best_policies'] + ']' if row['best_policies'] else ''}")
    print("µs per call under CUDA-graph replay; fa3* = FlashInfer fa3 measured earlier "
          "(another run); x fa3 > 1 means faster than fa3.")


if __name__ == "__main__":
    main()
