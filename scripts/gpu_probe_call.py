"""Two eager calls of the Triton decode entry point on one shape, for a profiler to catch.

Usage (GPU): ncu --section SpeedOfLight -k regex:sm90 \\
    python3 scripts/gpu_probe_call.py --heads 128 --batch 64 --kv-len 4096 [--q-len 1] \\
    [--block-size 64] [--splits N] [--set "warp_specialized=1 block_n=32 num_stages=4"]
The plan is the default one for the shape, with the --set changes to its configuration (one
value per field, in `mlaserve bench kernel --sweep`'s syntax). To time variants, use
`mlaserve bench kernel --sweep`; this script only gives a profiler two launches to catch.
"""

import argparse
import dataclasses
import math

import torch

from mlaserve.bench.kernel_sweep import parse_sweep
from mlaserve.kernels.mla_decode.common import device_capability
from mlaserve.kernels.mla_decode.launch import mla_decode_triton
from mlaserve.kernels.mla_decode.plan import describe, plan_mla_decode
from mlaserve.kernels.testing import poisoned_paged_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--kv-len", type=int, default=4096)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--splits", type=int, default=None, help="force this split count")
    parser.add_argument("--set", default=None, help="config changes: 'block_n=32 num_stages=4'")
    args = parser.parse_args()
    q, kv_cache, block_table, seq_lens = poisoned_paged_batch(
        [args.kv_len] * args.batch, args.heads, 512, 64, args.block_size, args.q_len,
        torch.bfloat16, 0, device=torch.device("cuda"))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_mla_decode(args.batch, args.kv_len, args.heads, args.q_len, 512, 64,
                           torch.bfloat16, num_sms, args.block_size, num_splits=args.splits,
                           capability=device_capability(q.device))
    changes = parse_sweep(args.set)[0] if args.set else {}
    if len(parse_sweep(args.set) if args.set else [{}]) != 1 or "num_splits" in changes:
        raise SystemExit("--set takes one value per configuration field (--splits for splits)")
    config = dataclasses.replace(plan.config, **changes)
    plan = plan_mla_decode(args.batch, args.kv_len, args.heads, args.q_len, 512, 64,
                           torch.bfloat16, num_sms, args.block_size, config=config,
                           num_splits=args.splits, capability=device_capability(q.device))
    for _ in range(2):
        mla_decode_triton(q, kv_cache, block_table, seq_lens, 1 / math.sqrt(576), 512,
                          args.q_len, plan)
    torch.cuda.synchronize()
    print(describe(plan))


if __name__ == "__main__":
    main()
