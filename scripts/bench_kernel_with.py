#!/usr/bin/env python
"""`mlaserve bench kernel` with one change applied to every default Triton decode configuration,
for A/B runs of a configuration knob against the peers in the same process.

Usage, from the repository root:

    python scripts/bench_kernel_with.py min_split_len=128,max_num_splits=16 -- \\
        --heads 16 --batch-sizes 64 --kv-lens 1024 --backends triton,flashinfer --out DIR

The changes (comma-separated name=value; ints, or strings) replace fields of what
`default_config` returns for 16-bit inputs; everything after `--` goes to `mlaserve bench kernel`.
"""

import dataclasses
import sys

from mlaserve import cli
from mlaserve.kernels import mla_decode_plan


def parse_changes(text: str) -> dict[str, int | str]:
    """'name=value,...' as configuration field changes (ints where the value is one)."""
    changes: dict[str, int | str] = {}
    for item in filter(None, text.split(",")):
        name, value = item.split("=")
        changes[name] = int(value) if value.lstrip("-").isdigit() else value
    return changes


def main() -> int:
    if len(sys.argv) < 2 or "--" not in sys.argv:
        raise SystemExit(__doc__)
    changes = parse_changes(sys.argv[1])
    bench_args = sys.argv[sys.argv.index("--") + 1:]
    default_config = mla_decode_plan.default_config

    def changed_config(*args, **kwargs) -> mla_decode_plan.MLADecodeConfig:
        config = default_config(*args, **kwargs)
        dtype = args[4] if len(args) > 4 else kwargs["dtype"]
        return dataclasses.replace(config, **changes) if dtype.itemsize == 2 else config

    # plan_mla_decode looks default_config up in its module at call time.
    mla_decode_plan.default_config = changed_config
    print(f"default configuration changes: {changes}", flush=True)
    return cli.main(["bench", "kernel", *bench_args])


if __name__ == "__main__":
    raise SystemExit(main())
