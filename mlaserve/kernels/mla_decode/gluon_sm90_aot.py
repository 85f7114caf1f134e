"""Compile the sm_90 Gluon split passes (`gluon_sm90`, `gluon_sm90_fp8`,
`gluon_sm90_fp8_transposed`) without a GPU, through Triton's bundled ptxas and with the argument
specialisation a launch gets: for resource checks (registers, spills, shared memory,
instruction mix) in CPU tests and `mlaserve bench kernel-diag resources`."""

import functools

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from mlaserve.kernels.mla_decode.common import GLUON_FP8_ROWS, GLUON_FP8_TRANSPOSED_TILE
from mlaserve.kernels.mla_decode.gluon_sm90 import (
    BLOCK_M,
    NUM_WARPS,
    _mla_decode_split_kernel_sm90,
    _shared_layout,
)

_TYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv"}


@functools.cache
def _signature(dtype: torch.dtype, kv_lora_rank: int, rope_dim: int, block_n: int,
               direct_output: bool, fp8_cache: bool) -> dict:
    type_name = _TYPE_NAMES[dtype]
    cache_dtype = torch.float8_e4m3fn if fp8_cache else dtype
    signature = {}
    for name, rows, width, element in (("q_nope_desc", BLOCK_M, kv_lora_rank, dtype),
                                       ("q_pe_desc", BLOCK_M, rope_dim, dtype),
                                       ("kv_nope_desc", block_n, kv_lora_rank, cache_dtype),
                                       ("kv_pe_desc", block_n, rope_dim, cache_dtype)):
        layout = _shared_layout(element, rows, width)
        signature[name] = f"tensordesc<{_TYPE_NAMES[element]}[{rows}, {width}],{layout!r}>"
    output_type = type_name if direct_output else "fp32"
    output_layout = _shared_layout(dtype if direct_output else torch.float32, BLOCK_M,
                                   kv_lora_rank // 2)
    return signature | {
        "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
        "o_desc": f"tensordesc<{output_type}[{BLOCK_M}, {kv_lora_rank // 2}],{output_layout!r}>",
        "o_ptr": f"*{output_type}", "lse_ptr": "*fp32",
        "qk_scale": "fp32", "q_len": "i32", "num_heads": "i32", "num_splits": "i32",
        "min_split_len": "i32", "split_len_ptr": "*i32",
        "stride_bt": "i32"}


def compile_for_sm90(
    dtype: torch.dtype = torch.bfloat16,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    block_n: int = 32,
    num_stages: int = 4,
    block_size: int = 64,
    direct_output: bool = False,
    tma_store: bool = True,
    fp8_stages: int = 0,
    balanced: bool = False,
):
    """The split pass compiled for sm_90 (over an FP8 cache staged in fp8_stages tiles where
    that is > 0; with `balanced`, balanced splits); returns
    Triton's CompiledKernel (asm["ptx"], asm["cubin"], metadata.shared)."""
    kernel = _mla_decode_split_kernel_sm90
    constexprs = dict(BLOCK_SIZE=block_size, NUM_STAGES=num_stages, DIRECT_OUTPUT=direct_output,
                      BALANCED=balanced, TMA_STORE=tma_store, FP8_STAGES=fp8_stages)
    signature = dict(_signature(dtype, kv_lora_rank, rope_dim, block_n, direct_output,
                                fp8_stages > 0))
    signature |= {name: "constexpr" for name in constexprs}
    aligned = ["block_table_ptr", "seq_lens_ptr", "o_ptr", "lse_ptr", "stride_bt"]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})


def compile_fp8_for_sm90(
    dtype: torch.dtype = torch.bfloat16,
    rope_dim: int = 64,
    block_n: int = 32,
    num_stages: int = 3,
    block_size: int = 64,
    direct_output: bool = False,
    transposed: bool = False,
    balanced: bool = False,
):
    """An FP8-cache pass compiled for sm_90 (`gluon_sm90_fp8`, or with `transposed`
    `gluon_sm90_fp8_transposed`, whose tiles are 64 keys whatever block_n says), q in dtype,
    the partials in float32 (or the final output in dtype), with `balanced` balanced splits;
    returns Triton's CompiledKernel."""
    from mlaserve.kernels.mla_decode import gluon_sm90_fp8, gluon_sm90_fp8_transposed

    type_name = _TYPE_NAMES[dtype]
    constexprs = dict(BLOCK_SIZE=block_size, NUM_STAGES=num_stages, DIRECT_OUTPUT=direct_output,
                      BALANCED=balanced)
    options = {"num_warps": gluon_sm90_fp8.NUM_WARPS}
    kernel = gluon_sm90_fp8._mla_decode_split_kernel_sm90_fp8
    if transposed:
        kernel = gluon_sm90_fp8_transposed._mla_decode_split_kernel_sm90_fp8_transposed
        block_n = GLUON_FP8_TRANSPOSED_TILE
        constexprs["ROWS"] = GLUON_FP8_ROWS
        options = {"num_warps": gluon_sm90_fp8_transposed.NUM_WARPS,
                   "maxnreg": gluon_sm90_fp8_transposed.LAUNCH_REGISTERS}
    chunk_layout, rope_layout = gluon_sm90_fp8.kv_layouts(block_n, rope_dim)
    signature = {
        "q_ptr": f"*{type_name}",
        "kv_desc": f"tensordesc<fp8e4nv[{block_n}, {gluon_sm90_fp8.CHUNK}],{chunk_layout!r}>",
        "pe_desc": f"tensordesc<fp8e4nv[{block_n}, {rope_dim}],{rope_layout!r}>",
        "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
        "o_ptr": f"*{type_name if direct_output else 'fp32'}", "lse_ptr": "*fp32",
        "qk_scale": "fp32", "q_len": "i32", "num_heads": "i32", "num_splits": "i32",
        "min_split_len": "i32", "split_len_ptr": "*i32",
        "stride_q_token": "i32", "stride_q_head": "i32", "stride_bt": "i32",
    } | {name: "constexpr" for name in constexprs}
    aligned = ["q_ptr", "block_table_ptr", "seq_lens_ptr", "o_ptr", "lse_ptr", "stride_q_token",
               "stride_q_head", "stride_bt"]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


__all__ = ["compile_fp8_for_sm90", "compile_for_sm90"]
