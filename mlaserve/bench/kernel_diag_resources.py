"""`mlaserve bench kernel-diag resources`: registers, stack, shared memory and instruction mix of
the Triton decode kernel and of the FP8 GEMM side's Triton kernels, for sm_90, without a GPU.

Usage: mlaserve bench kernel-diag resources
Compiles the stage-1 kernel (`_mla_decode_split_kernel`) with each anchor shape's default
configuration through Triton's bundled ptxas, with the argument specialisation a real launch
gets (16-byte aligned pointers and strides, q_len 1 folded in), and reads the cubin's resource
usage with the bundled cuobjdump. STACK > 0 means local memory (spills). Then the 16-head cells
over an FP8 cache (and a bf16 one) with TMA tiles and latent chunks, where the instruction mix
of the tile loop comes from the bundled nvdisasm: instructions per loop pass (a software-
pipelined loop's steady state: the shortest backward branch spanning HMMA instructions) per KV
token, local loads and stores (spills) in it, tensor-core and conversion instructions. Then the
Gluon pass's partitions, and the merge kernel's load layout with float32 and 16-bit partials.
Then the weight-only FP8 product in both operand orders (whether the converted weight tile
goes through shared memory: STS in its K loop), the norm and SiLU kernels that quantize their
output, and the fused MoE's two kernels at decode tiles in both operand orders, bf16 and FP8
(x W^T at 16 rows converts FP8 operands to float16 for mma.sync, F2FP; W x^T runs FP8 wgmma,
QGMMA, on them as they are).
"""

import itertools
import os
import re
import subprocess
import tempfile
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mlaserve.kernels import fp8_gemm, fused_moe, fused_norm_rope  # noqa: E402
from mlaserve.kernels.mla_decode import merge, triton_split  # noqa: E402
from mlaserve.kernels.mla_decode.common import GLUON_SM90_FP8, GLUON_SM90_FP8_T  # noqa: E402
from mlaserve.kernels.mla_decode.gluon_sm90_aot import compile_fp8_for_sm90  # noqa: E402
from mlaserve.kernels.mla_decode.plan import (  # noqa: E402
    MLADecodePlan,
    default_config,
    describe,
    plan_mla_decode,
)

KV_LORA_RANK, ROPE_DIM = 512, 64
SIGNATURE = {
    "q_ptr": "*bf16", "kv_ptr": "*bf16", "kv_nope_desc": "constexpr", "kv_pe_desc": "constexpr",
    "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
    "o_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32", "q_len": "i32",
    "num_heads": "i32", "num_splits": "i32", "min_split_len": "i32", "split_len_ptr": "*i32",
    "stride_q_token": "i32", "stride_q_head": "i32",
    "stride_kv_block": "i32", "stride_kv_slot": "i32", "stride_bt": "i32",
}
ALIGNED = ["q_ptr", "kv_ptr", "block_table_ptr", "seq_lens_ptr", "o_ptr", "lse_ptr", "num_heads",
           "min_split_len", "stride_q_token", "stride_q_head", "stride_kv_block",
           "stride_kv_slot", "stride_bt"]
# (heads, q_len, batch, kv_len, block_size)
SHAPES = [(16, 1, 1, 8192, 64), (16, 1, 64, 4096, 64), (16, 1, 512, 4096, 32),
          (16, 2, 64, 4096, 64), (16, 4, 64, 4096, 64), (128, 1, 1, 8192, 64),
          (128, 1, 64, 4096, 64)]
# Variants of the plan's configuration at 16 heads x batch 64 x kv 4096, pages of 64: the
# 2-d and split-latent passes with TMA tiles, over an FP8 and a bf16 cache, and the Gluon
# pass over FP8 caches.
VARIANTS = [dict(), dict(tma_loads=True), dict(tma_loads=True, latent_chunks=4, block_n=16,
                                               num_stages=4),
            dict(tma_loads=True, latent_chunks=4, block_n=16, num_stages=6),
            dict(tma_loads=True, latent_chunks=4, block_n=32, num_stages=4),
            dict(gluon_fp8=True, block_n=32, num_stages=3),
            dict(gluon_fp8=True, block_n=64, num_stages=2),
            dict(gluon_fp8=True, fp8_transposed=True, block_n=64, num_stages=2)]


def resources(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    fields = dict(item.split(":") for item in line.split() if ":" in item)
    return f"regs {fields['REG']:>3}  stack {fields['STACK']:>4} B"


def compile_split(plan: MLADecodePlan, block_size: int, q_len: int, cache: str,
                  tma: bool) -> triton.compiler.CompiledKernel:
    """The stage-1 kernel as `launch_split` would run `plan` (bf16 q; the cache's element type
    "bf16" or "fp8e4nv"), compiled for sm_90."""
    kernel = triton_split._mla_decode_split_kernel
    names = kernel.arg_names
    config = plan.config
    signature = dict(SIGNATURE, kv_ptr=f"*{cache}")
    constexprs = dict(kv_nope_desc=None, kv_pe_desc=None)
    if tma:
        chunks = config.latent_chunks
        nope_box = (f"{config.block_n},{KV_LORA_RANK}" if chunks == 1 else
                    f"{config.block_n},{chunks},{KV_LORA_RANK // chunks}")
        signature["kv_nope_desc"] = f"tensordesc<{cache}[{nope_box}]>"
        signature["kv_pe_desc"] = f"tensordesc<{cache}[{config.block_n},{ROPE_DIM}]>"
        constexprs = {}
    constexprs |= dict(KV_LORA_RANK=KV_LORA_RANK, ROPE_DIM=ROPE_DIM, BLOCK_SIZE=block_size,
                      BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                      NUM_STAGES=config.num_stages, DOT_PRECISION="tf32",
                      DIRECT_OUTPUT=plan.num_splits == 1, USE_PDL=True, USE_TMA=tma,
                      PAGE_CHUNK=plan.page_chunk, FP16_DOTS=plan.fp16_dots,
                      BALANCED=plan.split_slots > 0, LATENT_CHUNKS=config.latent_chunks)
    if q_len == 1:
        constexprs["q_len"] = 1  # the launcher specialises integer arguments equal to 1
    signature |= {name: "constexpr" for name in constexprs}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
    return triton.compile(
        ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages})


def tile_loop_mix(cubin: bytes) -> dict[str, int]:
    """Instruction counts of the tile loop's steady state in the cubin's SASS: the shortest
    span of a backward branch that holds tensor-core instructions (HMMA: mma.sync; HGMMA and
    QGMMA: wgmma on 16-bit and on FP8 operands)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    labels, code = {}, []
    for line in sass.splitlines():
        label = re.match(r"^\.(L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(code)
        elif instruction := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*)", line):
            code.append(instruction.group(1))
    loops = []
    for end, text in enumerate(code):
        target = re.search(r"BRA `\(\.(L_x_\d+)\)", text)
        start = labels.get(target.group(1), end) if target else end
        body = code[start:end + 1]
        if start < end and any(unit in op for op in body for unit in ("HMMA", "GMMA")):
            loops.append(body)
    body = min(loops, key=len)
    ops = [op.split()[1] if op.startswith("@") else op.split()[0] for op in body]
    count = {name: sum(op.split(".")[0] == name for op in ops)  # LDS: not LDSM
             for name in ("LDL", "STL", "HMMA", "HGMMA", "QGMMA", "F2FP", "PRMT", "LDS", "LDSM",
                          "STS", "FMUL", "BAR")}
    return {"instructions": len(ops), **count}


def anchor_shapes() -> None:
    """The stage-1 kernel at each anchor shape's default configuration, with pointer loads and
    with TMA tiles: its configuration, resources and PTX instruction counts."""
    for (heads, q_len, batch, kv_len, block_size), tma in itertools.product(SHAPES, (False, True)):
        plan = plan_mla_decode(batch, kv_len, heads, q_len, KV_LORA_RANK, ROPE_DIM,
                               torch.bfloat16, 132, block_size)
        config = plan.config
        compiled = compile_split(plan, block_size, q_len, "bf16", tma)
        ptx = compiled.asm["ptx"]
        print(f"H{heads:<3} q{q_len} B{batch:<3} kv{kv_len:<5} blk{block_size:<2} "
              f"{'TMA ' if tma else 'ptrs'}: "
              f"block_m {config.block_m:>2} block_n {config.block_n} warps {config.num_warps} "
              f"stages {config.num_stages} | {resources(compiled.asm['cubin'])}  shared "
              f"{compiled.metadata.shared // 1024:>3} KB | wgmma "
              f"{ptx.count('wgmma.mma_async'):>2}  mma.sync {ptx.count('mma.sync'):>3}  "
              f"cp.async {ptx.count('cp.async.cg') + ptx.count('cp.async.ca'):>2}  "
              f"TMA {ptx.count('cp.async.bulk.tensor')}")


def cache_variants() -> None:
    """16 heads x batch 64 x kv 4096, pages of 64: each of VARIANTS over an FP8 and a bf16
    cache, with the tile loop's instruction mix per KV token."""
    for cache, changes in itertools.product(("fp8e4nv", "bf16"), VARIANTS):
        kv_dtype = torch.float8_e4m3fn if cache == "fp8e4nv" else torch.bfloat16
        config = replace(default_config(16, 1, KV_LORA_RANK, ROPE_DIM, torch.bfloat16, 64, 4096,
                                        64), **changes)
        plan = plan_mla_decode(64, 4096, 16, 1, KV_LORA_RANK, ROPE_DIM, torch.bfloat16, 132, 64,
                               config=config, capability=(9, 0), kv_cache_dtype=kv_dtype)
        if plan.kernel in (GLUON_SM90_FP8, GLUON_SM90_FP8_T):
            compiled = compile_fp8_for_sm90(block_n=config.block_n,
                                            num_stages=config.num_stages,
                                            transposed=plan.kernel == GLUON_SM90_FP8_T)
        elif changes.get("gluon_fp8"):
            continue  # the FP8 pass reads FP8 caches only
        else:
            compiled = compile_split(plan, 64, 1, cache, plan.tma_loads)
        mix = tile_loop_mix(compiled.asm["cubin"])
        per_token = mix["instructions"] / config.block_n
        print(f"{cache:7} {describe(plan):80} | {resources(compiled.asm['cubin'])}  shared "
              f"{compiled.metadata.shared // 1024:>3} KB | loop {mix['instructions']:>4} "
              f"({per_token:4.1f}/token): LDL {mix['LDL']} STL {mix['STL']} HMMA "
              f"{mix['HMMA']} HGMMA {mix['HGMMA']} QGMMA {mix['QGMMA']} F2FP {mix['F2FP']} PRMT "
              f"{mix['PRMT']} LDS "
              f"{mix['LDS']} LDSM {mix['LDSM']} STS {mix['STS']} FMUL {mix['FMUL']} BAR "
              f"{mix['BAR']}")


def warp_specialized() -> None:
    """The Gluon split pass (`gluon_sm90`): its partitions' register budgets are set by
    setmaxnreg, so those are printed next to the launch limit. 64-token tiles are compiled too,
    though `supported` refuses them, to show why (their spills)."""
    from mlaserve.kernels.mla_decode.gluon_sm90_aot import compile_for_sm90

    for (block_n, num_stages), direct in (((32, 4), False), ((32, 4), True), ((64, 2), False)):
        compiled = compile_for_sm90(block_n=block_n, num_stages=num_stages, direct_output=direct)
        ptx = compiled.asm["ptx"]
        setmaxnreg = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)",
                                           ptx)))
        print(f"seesaw sm_90 pass n{block_n} s{num_stages} "
              f"({'direct' if direct else 'partials'}): {compiled.metadata.num_warps} warps | "
              f"launch {resources(compiled.asm['cubin'])}, setmaxnreg "
              f"{' '.join(f'{op} {n}' for op, n in setmaxnreg)} | shared "
              f"{compiled.metadata.shared // 1024} KB | wgmma {ptx.count('wgmma.mma_async')}  "
              f"TMA {ptx.count('cp.async.bulk.tensor')}  bar.sync {ptx.count('bar.sync')}")


def merge_kernel() -> None:
    """The merge kernel at 4 rows x 512 columns a program, float32 and 16-bit partials: with 4
    splits a chunk (one load per split, the batch-64 case) and 16 (one wide [splits, rows,
    columns] load, the batch-1 case, whose blocked layout is printed: warps along the split
    axis make the sum over splits cross warps, through shared memory); shared memory and
    barriers of each."""
    kernel = merge._mla_decode_merge_kernel
    names = kernel.arg_names
    for split_chunk, partial in itertools.product((4, 16), ("fp32", "bf16")):
        signature = {"partial_o_ptr": f"*{partial}", "partial_lse_ptr": "*fp32",
                     "o_ptr": "*bf16", "lse_ptr": "*fp32", "num_rows": "i32",
                     "num_splits": "i32"}
        constexprs = dict(KV_LORA_RANK=KV_LORA_RANK, BLOCK_R=4, BLOCK_L=KV_LORA_RANK,
                          SPLIT_CHUNK=split_chunk, USE_PDL=True)
        signature |= {name: "constexpr" for name in constexprs}
        attrs = {(names.index(name),): [["tt.divisibility", 16]]
                 for name in ("partial_o_ptr", "partial_lse_ptr", "o_ptr", "lse_ptr", "num_rows")}
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        layouts = re.findall(r"blocked<\{sizePerThread = \[1, 1, \d+\][^>]*warpsPerCTA = "
                             r"(\[[\d, ]+\])", compiled.asm["ttgir"])
        load = f"3-d load warpsPerCTA {' '.join(layouts)}" if layouts else "a load per split"
        print(f"merge kernel, {split_chunk} splits a chunk, {partial} partials: {load} | "
              f"shared {compiled.metadata.shared // 1024} KB | bar.sync "
              f"{compiled.asm['ptx'].count('bar.sync')}")


def fp8_gemm_kernels() -> None:
    """The weight-only FP8 product (bf16 x, K split) at the tiles the sweep tries, in both
    operand orders: x W^T stores each converted weight tile to shared memory for wgmma (STS in
    the K loop), W x^T hands it to wgmma from registers. Then the norm and SiLU kernels of a
    V3 layer with and without quantizing their output."""
    kernel = fp8_gemm._fp8_weight_only_matmul_kernel
    names = kernel.arg_names
    for (block_m, block_n), swap_ab in itertools.product(
            ((16, 32), (16, 64), (64, 32), (64, 64), (64, 128)), (False, True)):
        signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "y_ptr": "*fp32",
                     "w_scale_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                     "stride_xm": "i32", "stride_wn": "i32", "stride_ws": "i32",
                     "BLOCKS_PER_SPLIT": "i32"}
        constexprs = dict(stride_xk=1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128,
                          K_BLOCKS=1, SPLIT_K=True, INPUT_PRECISION="tf32", SWAP_AB=swap_ab)
        signature |= {name: "constexpr" for name in constexprs}
        attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in
                 ("x_ptr", "w_ptr", "y_ptr", "w_scale_ptr", "N", "K", "stride_xm", "stride_wn")}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs,
                                            attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "num_stages": 4})
        mix = tile_loop_mix(compiled.asm["cubin"])
        print(f"weight-only {'W x^T' if swap_ab else 'x W^T'} {block_m:>2}x{block_n:<3}: "
              f"{resources(compiled.asm['cubin'])}  shared "
              f"{compiled.metadata.shared // 1024:>3} KB | K loop {mix['instructions']:>4}: "
              f"HGMMA {mix['HGMMA']} HMMA {mix['HMMA']} STS {mix['STS']} LDSM {mix['LDSM']} "
              f"F2FP {mix['F2FP']} BAR {mix['BAR']}")
    for name, kernel, width, block, quantize in (
            ("input norm", fused_norm_rope._rms_norm_kernel, 7168, 8192, False),
            ("input norm", fused_norm_rope._rms_norm_kernel, 7168, 8192, True),
            ("SiLU-and-mul", fused_norm_rope._silu_and_mul_kernel, 18432, 1024, False),
            ("SiLU-and-mul", fused_norm_rope._silu_and_mul_kernel, 18432, 1024, True)):
        signature = {arg: "i32" for arg in kernel.arg_names if arg.startswith(("stride", "n_",
                                                                               "inter"))}
        signature |= {arg: "*bf16" for arg in kernel.arg_names if arg.endswith("_ptr")}
        if quantize:
            signature |= {"values_ptr": "*fp8e4nv", "scales_ptr": "*fp32"}
        constexprs = dict(QUANTIZE=quantize, FP8_MAX=448.0, GROUP=128)
        if "eps" in kernel.arg_names:
            signature["eps"] = "fp32"
            constexprs |= dict(BLOCK_N=block, ADD_RESIDUAL=True)
        else:
            constexprs |= dict(BLOCK=block)
        signature |= {arg: "constexpr" for arg in constexprs}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": max(1, min(16, block // 256))})
        ptx = compiled.asm["ptx"]
        print(f"{name} [*, {width}] {'quantized' if quantize else 'bf16'} output: "
              f"{resources(compiled.asm['cubin'])}  shared {compiled.metadata.shared} B | "
              f"e4m3 conversions {ptx.count('e4m3')}  bar.sync {ptx.count('bar.sync')}")


def moe_kernels() -> None:
    """The fused MoE's gate_up and down kernels at the decode tiles of `default_config` (16
    rows, 64 columns, 128-deep K steps), bf16 and FP8 weights, as laid out and transposed
    (`GemmTiles.swap_ab`): registers, shared memory and the K loop's instruction mix."""
    index_args = ("sorted_ids_ptr", "expert_ids_ptr", "num_padded_ptr")
    for (name, kernel, num_stages), fp8, swap_ab in itertools.product(
            (("gate_up", fused_moe._gate_up_silu_kernel, 3), ("down", fused_moe._down_kernel, 4)),
            (False, True), (False, True)):
        names = kernel.arg_names
        signature = {arg: "i32" for arg in names}
        for arg in (arg for arg in names if arg.endswith("_ptr")):
            signature[arg] = ("*i32" if arg in index_args else
                              "*fp32" if "scale" in arg or "topk" in arg else "*bf16")
        if fp8:
            signature |= {"w_ptr": "*fp8e4nv", names[0]: "*fp8e4nv"}  # x or act, and w
        constexprs = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_SIZE_M=1, EVEN_K=True,
                          DOT_PRECISION=None, FP8=fp8, SWAP_AB=swap_ab)
        # unit K strides, which the launcher specialises to 1
        constexprs |= {arg: 1 for arg in ("stride_xd", "stride_wd", "stride_wk") if arg in names}
        signature |= {arg: "constexpr" for arg in constexprs}
        aligned = [arg for arg in names if arg.endswith("_ptr")] + [
            arg for arg in ("hidden", "inter", "stride_xt", "stride_am", "stride_we",
                            "stride_wn", "stride_om") if arg in names]
        attrs = {(names.index(arg),): [["tt.divisibility", 16]] for arg in aligned}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs,
                                            attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "num_stages": num_stages})
        mix = tile_loop_mix(compiled.asm["cubin"])
        print(f"MoE {name:7} {'fp8 ' if fp8 else 'bf16'} {'W x^T' if swap_ab else 'x W^T'}: "
              f"{resources(compiled.asm['cubin'])}  shared "
              f"{compiled.metadata.shared // 1024:>3} KB | K loop {mix['instructions']:>4}: "
              f"HMMA {mix['HMMA']} HGMMA {mix['HGMMA']} QGMMA {mix['QGMMA']} F2FP "
              f"{mix['F2FP']} LDSM {mix['LDSM']}")


def report_all() -> None:
    """Every report of this module, in order."""
    anchor_shapes()
    cache_variants()
    warp_specialized()
    merge_kernel()
    fp8_gemm_kernels()
    moe_kernels()
