"""`mlaserve bench gemm-tune MODE`: the FP8 GEMM kernels' launch configurations swept on
DeepSeek-V3's projection shapes, or profiled, so that their defaults and dispatch bounds can be
set from one run. `mlaserve bench gemm` times what a layer runs; this times the kernels apart.

Modes (each needs a GPU; every output is checked against the float32 product of the same
dequantized operands before it is timed, and a failure makes the exit status 1):
  gluon        the warp-specialised sm_90 block-FP8 GEMM (`fp8_gemm_sm90`) against bf16 and
               cuBLASLt's blockwise product, its num_stages, k_unroll, group_m, tile width and
               runs of K blocks swept (H100 / H200; `gemm_tune_gluon.py`):
               mlaserve bench gemm-tune gluon [--models deepseek-v3]
                   [--tokens 256,1024,4096,8192] [--stages 4,5,6] [--k-unroll 1,2,4]
                   [--group-m 8] [--block-n 128,64] [--k-splits 1] [--repeats 10]
                   [--out FILE.json]
  weight-only  the weight-only product (w8a16, `fp8_weight_only_matmul`) against bf16 and the
               w8a8 path, its tiles, K splits, K blocks, stages, warps and operand order swept
               (`gemm_tune_weight_only.py`):
               mlaserve bench gemm-tune weight-only [--shapes 2112x7168,24576x1536,...]
                   [--tokens 1,16,32,64,128] [--block-n 16,32,64] [--k-splits 1,2,4,8]
                   [--k-blocks 1,4] [--stages 3,4,5] [--warps 2,4] [--swap-ab 0,1]
                   [--repeats 10] [--out FILE.json]
  profile      where the Gluon GEMM's time goes: it beside cuBLASLt's blockwise, cuBLAS's
               per-tensor FP8 and bf16 products, timed, and each launched once more inside the
               NVTX range `profile` for Nsight Compute (sm_90; `gemm_tune_profile.py`):
               mlaserve bench gemm-tune profile [--shapes o_proj:4096,q_a+kv_a_proj:1024]
                   [--repeats 10]
               Under ncu: ncu --nvtx --nvtx-include "profile/" --clock-control none
                   --section ... python3 -m mlaserve bench gemm-tune profile --repeats 1
"""

import argparse
import importlib

from mlaserve.arg_types import bool_list, positive_int_list

# N x K of DeepSeek-V3 at one rank: q_a_proj and kv_a_proj_with_mqa fused (1536 + 576), q_b_proj,
# o_proj, the dense MLP's gate_up and down, one routed expert's gate_up and down
V3_SHAPES = "2112x7168,24576x1536,7168x16384,36864x7168,7168x18432,4096x7168,7168x2048"
MODES = {"gluon": "mlaserve.bench.gemm_tune_gluon",
         "weight-only": "mlaserve.bench.gemm_tune_weight_only",
         "profile": "mlaserve.bench.gemm_tune_profile"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The modes of `mlaserve bench gemm-tune` and their flags."""
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    repeats = dict(type=int, default=10, help="timed rounds of graph replays")
    out = dict(default=None, help="write the rows as JSON here")

    gluon = modes.add_parser("gluon", help="the sm_90 Gluon w8a8 GEMM's configurations swept")
    gluon.add_argument("--models", default="deepseek-v3", help="comma list of config names")
    gluon.add_argument("--tokens", type=positive_int_list, default="256,1024,4096,8192",
                       help="comma list of token counts M")
    gluon.add_argument("--stages", type=positive_int_list, default="4,5,6",
                       help="swept num_stages")
    gluon.add_argument("--k-unroll", type=positive_int_list, default="1,2,4",
                       help="swept k_unroll")
    gluon.add_argument("--group-m", type=positive_int_list, default="8", help="swept group_m")
    gluon.add_argument("--block-n", type=positive_int_list, default="128,64",
                       help="swept tile widths")
    gluon.add_argument("--k-splits", type=positive_int_list, default="1",
                       help="swept runs of K blocks (the default, `choose_k_splits`, is timed "
                            "as `gluon`)")
    gluon.add_argument("--repeats", **repeats)
    gluon.add_argument("--out", **out)

    weight_only = modes.add_parser("weight-only",
                                   help="the weight-only (w8a16) product's configurations swept")
    weight_only.add_argument("--shapes", default=V3_SHAPES,
                             help="comma list of NxK weight shapes")
    weight_only.add_argument("--tokens", type=positive_int_list, default="1,16,32,64,128",
                             help="comma list of token counts M")
    weight_only.add_argument("--block-n", type=positive_int_list, default="16,32,64",
                             help="swept BLOCK_N (16, 32, 64, 128)")
    weight_only.add_argument("--k-splits", type=positive_int_list, default="1,2,4,8",
                             help="swept K splits")
    weight_only.add_argument("--k-blocks", type=positive_int_list, default="1,4",
                             help="swept K blocks per step (1-8)")
    weight_only.add_argument("--stages", type=positive_int_list, default="3,4,5",
                             help="swept num_stages")
    weight_only.add_argument("--warps", type=positive_int_list, default="2,4",
                             help="swept num_warps")
    weight_only.add_argument("--swap-ab", type=bool_list, default="0,1",
                             help="swept operand orders: 0 x W^T, 1 W x^T")
    weight_only.add_argument("--repeats", **repeats)
    weight_only.add_argument("--out", **out)

    profile = modes.add_parser("profile",
                               help="the Gluon GEMM beside cuBLAS's products, for Nsight Compute")
    profile.add_argument("--shapes", default="o_proj:4096,q_a+kv_a_proj:1024",
                         help="comma list of projection:tokens (projections of "
                              "`bench.gemm.projections(deepseek-v3)`)")
    profile.add_argument("--repeats", **repeats)


def run(args: argparse.Namespace) -> int:
    """Run the mode's module."""
    return importlib.import_module(MODES[args.mode]).run(args)
