"""`mlaserve bench kernel-diag MODE`: diagnostics of the decode kernels, beside the timings of
`mlaserve bench kernel`.

Modes:
  resources        registers, stack (spills), shared memory and instruction mix of the Triton
                   decode kernel, the Gluon passes, the merge kernel and the FP8 GEMM side's
                   Triton kernels, compiled for sm_90 without a GPU (`kernel_diag_resources.py`):
                   mlaserve bench kernel-diag resources
  trace            timeline of the seesaw Gluon split pass from in-kernel %globaltimer stamps,
                   per-cell medians and trace_<cell>.npy (GPU; `kernel_diag_trace.py`):
                   mlaserve bench kernel-diag trace [--cells 128x64x1024x1,...] [--out DIR]
  probe            two eager calls of the Triton decode entry point on one shape, for a
                   profiler to catch (GPU):
                   ncu --section SpeedOfLight -k regex:sm90 python3 -m mlaserve bench
                       kernel-diag probe --heads 128 --batch 64 --kv-len 4096 [--q-len 1]
                       [--block-size 64] [--splits N]
                       [--set "warp_specialized=1 block_n=32 num_stages=4"]
                   The plan is the default one for the shape, with the --set changes to its
                   configuration (one value per field, in `mlaserve bench kernel --sweep`'s
                   syntax). To time variants, use `mlaserve bench kernel --sweep`; this only
                   gives a profiler two launches to catch.
  flashinfer-warm  compile one FlashInfer MLA module ahead of use (GPU; the first use of each
                   takes about a minute):
                   mlaserve bench kernel-diag flashinfer-warm fa3|fa2 bfloat16|float16
"""

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The modes of `mlaserve bench kernel-diag` and their flags."""
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    modes.add_parser("resources", help="compiled resources and instruction mix (no GPU)")

    trace = modes.add_parser("trace", help="in-kernel timeline of the seesaw Gluon pass")
    trace.add_argument("--cells", default="128x64x1024x1,128x64x4096x1,128x512x1024x1,16x64x4096x4",
                       help="comma list of heads x batch x kv length x q_len (block 64, the "
                            "default plan)")
    trace.add_argument("--out", default=".", help="directory for the .npy stamps and summary")

    probe = modes.add_parser("probe", help="two launches of the Triton decode for a profiler")
    probe.add_argument("--heads", type=int, default=128)
    probe.add_argument("--batch", type=int, default=64)
    probe.add_argument("--kv-len", type=int, default=4096)
    probe.add_argument("--q-len", type=int, default=1)
    probe.add_argument("--block-size", type=int, default=64)
    probe.add_argument("--splits", type=int, default=None, help="force this split count")
    probe.add_argument("--set", default=None, help="config changes: 'block_n=32 num_stages=4'")

    warm = modes.add_parser("flashinfer-warm", help="compile one FlashInfer MLA module")
    warm.add_argument("variant", choices=("fa3", "fa2"))
    warm.add_argument("dtype", choices=("bfloat16", "float16"))


def run(args: argparse.Namespace) -> int:
    """Run the mode."""
    if args.mode == "resources":
        os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter
        from mlaserve.bench.kernel_diag_resources import report_all

        report_all()
    elif args.mode == "trace":
        from mlaserve.bench.kernel_diag_trace import trace_cells

        trace_cells(args)
    elif args.mode == "probe":
        probe_call(args)
    else:
        warm_flashinfer(args.variant, args.dtype)
    return 0


def probe_call(args: argparse.Namespace) -> None:
    """Two eager calls of `mla_decode_triton` with the shape's plan (and --set changes); prints
    the plan."""
    import dataclasses
    import math

    import torch

    from mlaserve.bench.kernel_sweep import parse_sweep
    from mlaserve.kernels.mla_decode.common import device_capability
    from mlaserve.kernels.mla_decode.launch import mla_decode_triton
    from mlaserve.kernels.mla_decode.plan import describe, plan_mla_decode
    from mlaserve.kernels.testing import poisoned_paged_batch

    q, kv_cache, block_table, seq_lens = poisoned_paged_batch(
        [args.kv_len] * args.batch, args.heads, 512, 64, args.block_size, args.q_len,
        torch.bfloat16, 0, device=torch.device("cuda"))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_mla_decode(args.batch, args.kv_len, args.heads, args.q_len, 512, 64,
                           torch.bfloat16, num_sms, args.block_size, num_splits=args.splits,
                           capability=device_capability(q.device))
    changes = parse_sweep(args.set)[0] if args.set else {}
    if len(parse_sweep(args.set) if args.set else [{}]) != 1 or "num_splits" in changes:
        raise ValueError("--set takes one value per configuration field (--splits for splits)")
    config = dataclasses.replace(plan.config, **changes)
    plan = plan_mla_decode(args.batch, args.kv_len, args.heads, args.q_len, 512, 64,
                           torch.bfloat16, num_sms, args.block_size, config=config,
                           num_splits=args.splits, capability=device_capability(q.device))
    for _ in range(2):
        mla_decode_triton(q, kv_cache, block_table, seq_lens, 1 / math.sqrt(576), 512,
                          args.q_len, plan)
    torch.cuda.synchronize()
    print(describe(plan))


def warm_flashinfer(variant: str, dtype: str) -> None:
    """Plan one FlashInfer MLA batch (16 heads), which compiles its module; prints
    `compiled VARIANT DTYPE`."""
    import torch

    from mlaserve.attention.base import MLAShape
    from mlaserve.attention.flashinfer_backend import (
        FlashInferFA2MLABackend,
        FlashInferMLABackend,
    )

    cls = FlashInferFA2MLABackend if variant == "fa2" else FlashInferMLABackend
    shape = MLAShape(16, 512, 64, 64, getattr(torch, dtype), torch.device("cuda"))
    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    cls(shape, 192 ** -0.5).plan(table, torch.ones(1, dtype=torch.int32, device="cuda"))
    print(f"compiled {variant} {dtype}")
