"""`mlaserve bench prefill`: the expanded-MHA prefill attention of one layer, implementations
side by side (GPU).

Usage (GPU): mlaserve bench prefill [--heads 16] [--impls sdpa,4d,flashinfer] [--out DIR]
For each step shape (chunks of new tokens over cached context: `prefill_impls.STEPS`) it times
each implementation's whole step for one layer (kv_b expansion included) and checks it against
a float32 reference that attends with the same inputs: the largest absolute error over the
outputs. Implementations (`--impls`): sdpa, the engine's `expanded_prefill`; 4d, SDPA on 4-d
inputs with torch's choice and with each fused backend forced (V padded where it needs equal
head dims); flashinfer, FlashInfer's ragged prefill, where it is installed. Writes the lines to
--out/prefill-attention-IMPLS.txt.
"""

import argparse

IMPLS = ("sdpa", "4d", "flashinfer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench prefill` flags."""
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--out", default=None, help="directory for the result lines")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma list of {', '.join(IMPLS)}")


def run(args: argparse.Namespace) -> int:
    """Time and check every implementation on every step shape."""
    import torch

    from mlaserve.bench.prefill_impls import time_implementations

    if not torch.cuda.is_available():
        raise ValueError("mlaserve bench prefill times GPU kernels: it needs a CUDA GPU")
    lines = time_implementations(args.heads, args.impls.split(","), torch.device("cuda"))
    if args.out:
        from pathlib import Path

        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = f"prefill-attention-{args.impls.replace(',', '-')}.txt"
        (Path(args.out) / name).write_text("\n".join(lines) + "\n")
    return 0
