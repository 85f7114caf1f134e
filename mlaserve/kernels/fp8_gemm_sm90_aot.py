"""Compile the sm_90 block-FP8 GEMM (`fp8_gemm_sm90`) without a GPU, through Triton's bundled
ptxas and with the argument specialisation a launch gets: for resource checks (registers,
spills, shared memory, instruction mix) in CPU tests."""

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from mlaserve.kernels.fp8_gemm_sm90 import (
    NUM_WARPS,
    _block_fp8_matmul_kernel_sm90,
    operand_layouts,
)
from mlaserve.kernels.fp8_gemm_sm90_plan import (
    BLOCK_K,
    BLOCK_M,
    DEFAULT_GROUP_M,
    DEFAULT_K_UNROLL,
    DEFAULT_STAGES,
)


def compile_for_sm90(out_dtype: torch.dtype = torch.bfloat16, num_stages: int = DEFAULT_STAGES,
                     group_m: int = DEFAULT_GROUP_M, k_unroll: int = DEFAULT_K_UNROLL,
                     block_n: int = 128):
    """The kernel compiled for sm_90 without a GPU (Triton's bundled ptxas), with the argument
    specialisation of a launch from `block_fp8_w8a8` (x's scales M-major: stride_xs_m = 1,
    which Triton makes a constant; M, and so stride_xs_k, of any divisibility; out_dtype
    float32 for the partial sums of a split K): Triton's CompiledKernel (asm["ptx"],
    asm["cubin"], metadata.shared), for resource checks in CPU tests."""
    kernel = _block_fp8_matmul_kernel_sm90
    out_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[out_dtype]
    x_layout, w_layout, out_layout = operand_layouts(out_dtype, block_n)
    constexprs = dict(stride_xs_m=1, NUM_STAGES=num_stages, GROUP_M=group_m, K_UNROLL=k_unroll)
    signature = {
        "x_desc": f"tensordesc<fp8e4nv[{BLOCK_M}, {BLOCK_K}],{x_layout!r}>",
        "w_desc": f"tensordesc<fp8e4nv[{block_n}, {BLOCK_K}],{w_layout!r}>",
        "y_desc": f"tensordesc<{out_name}[{BLOCK_M // 2}, {block_n}],{out_layout!r}>",
        "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "partial_ptr": "*fp32",
        "flag_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "blocks_per_split": "i32",
        "stream_k_tiles": "i32", "stride_xs_k": "i32", "stride_ws_n": "i32",
    } | {name: "constexpr" for name in constexprs}
    aligned = ["x_scale_ptr", "w_scale_ptr", "partial_ptr", "flag_ptr", "N", "K", "stride_ws_n"]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})


__all__ = ["compile_for_sm90"]
