"""Two eager calls of the Triton decode entry point on one shape, for a profiler to catch.

Usage (GPU): ncu --section SpeedOfLight -k regex:sm90 \\
    python3 scripts/gpu_probe_call.py --heads 128 --batch 64 --kv-len 4096 [--q-len 1] \\
    [--block-size 64] [--splits N] [--set warp_specialized=1,block_n=32,num_stages=4]
The plan is the default one for the shape, with the --set changes to its configuration.
"""

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernel_with import parse_changes  # noqa: E402

from mlaserve.kernels.mla_decode.common import device_capability  # noqa: E402
from mlaserve.kernels.mla_decode.launch import mla_decode_triton  # noqa: E402
from mlaserve.kernels.mla_decode.plan import describe, plan_mla_decode  # noqa: E402
from mlaserve.kernels.testing import poisoned_paged_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--kv-len", type=int, default=4096)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--splits", type=int, default=None, help="force this split count")
    parser.add_argument("--set", default="", help="config changes, e.g. block_n=32,num_stages=4")
    args = parser.parse_args()
    q, kv_cache, block_table, seq_lens = poisoned_paged_batch(
        [args.kv_len] * args.batch, args.heads, 512, 64, args.block_size, args.q_len,
        torch.bfloat16, 0, device=torch.device("cuda"))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_mla_decode(args.batch, args.kv_len, args.heads, args.q_len, 512, 64,
                           torch.bfloat16, num_sms, args.block_size, num_splits=args.splits,
                           capability=device_capability(q.device))
    config = dataclasses.replace(plan.config, **parse_changes(args.set))
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
