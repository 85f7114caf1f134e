"""Registers, stack, shared memory and instruction mix of the Triton decode kernel, for sm_90,
without a GPU.

Usage: python scripts/kernel_resources.py
Compiles the stage-1 kernel (`_mla_decode_split_kernel`) with each anchor shape's default
configuration through Triton's bundled ptxas, with the argument specialisation a real launch
gets (16-byte aligned pointers and strides, q_len 1 folded in), and reads the cubin's resource
usage with the bundled cuobjdump. STACK > 0 means local memory (spills). Then the Gluon pass's
partitions, and the merge kernel's load layout with float32 and 16-bit partials.
"""

import itertools
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mlaserve.kernels.mla_decode import triton_split  # noqa: E402
from mlaserve.kernels.mla_decode.plan import plan_mla_decode  # noqa: E402

KV_LORA_RANK, ROPE_DIM = 512, 64
SIGNATURE = {
    "q_ptr": "*bf16", "kv_ptr": "*bf16", "kv_nope_desc": "constexpr", "kv_pe_desc": "constexpr",
    "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
    "o_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32", "q_len": "i32",
    "num_heads": "i32", "num_splits": "i32", "min_split_len": "i32", "stride_q_token": "i32",
    "stride_q_head": "i32", "stride_kv_block": "i32", "stride_kv_slot": "i32", "stride_bt": "i32",
}
ALIGNED = ["q_ptr", "kv_ptr", "block_table_ptr", "seq_lens_ptr", "o_ptr", "lse_ptr", "num_heads",
           "min_split_len", "stride_q_token", "stride_q_head", "stride_kv_block",
           "stride_kv_slot", "stride_bt"]
# (heads, q_len, batch, kv_len, block_size)
SHAPES = [(16, 1, 1, 8192, 64), (16, 1, 64, 4096, 64), (16, 1, 512, 4096, 32),
          (16, 2, 64, 4096, 64), (16, 4, 64, 4096, 64), (128, 1, 1, 8192, 64),
          (128, 1, 64, 4096, 64)]


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


def main() -> None:
    kernel = triton_split._mla_decode_split_kernel
    names = kernel.arg_names
    for (heads, q_len, batch, kv_len, block_size), tma in itertools.product(SHAPES, (False, True)):
        plan = plan_mla_decode(batch, kv_len, heads, q_len, KV_LORA_RANK, ROPE_DIM,
                               torch.bfloat16, 132, block_size)
        config = plan.config
        signature = dict(SIGNATURE)
        constexprs = dict(kv_nope_desc=None, kv_pe_desc=None)
        if tma:
            for name, width in (("kv_nope_desc", KV_LORA_RANK), ("kv_pe_desc", ROPE_DIM)):
                signature[name] = f"tensordesc<bf16[{config.block_n},{width}]>"
                constexprs.pop(name)
        constexprs |= dict(KV_LORA_RANK=KV_LORA_RANK, ROPE_DIM=ROPE_DIM, BLOCK_SIZE=block_size,
                          BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                          NUM_STAGES=config.num_stages, DOT_PRECISION="tf32",
                          DIRECT_OUTPUT=False, USE_PDL=True, USE_TMA=tma,
                          PAGE_CHUNK=plan.page_chunk)
        if q_len == 1:
            constexprs["q_len"] = 1  # the launcher specialises integer arguments equal to 1
        signature |= {name: "constexpr" for name in constexprs}
        attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": config.num_warps, "num_stages": config.num_stages})
        ptx = compiled.asm["ptx"]
        print(f"H{heads:<3} q{q_len} B{batch:<3} kv{kv_len:<5} blk{block_size:<2} "
              f"{'TMA ' if tma else 'ptrs'}: "
              f"block_m {config.block_m:>2} block_n {config.block_n} warps {config.num_warps} "
              f"stages {config.num_stages} | {resources(compiled.asm['cubin'])}  shared "
              f"{compiled.metadata.shared // 1024:>3} KB | wgmma "
              f"{ptx.count('wgmma.mma_async'):>2}  mma.sync {ptx.count('mma.sync'):>3}  "
              f"cp.async {ptx.count('cp.async.cg') + ptx.count('cp.async.ca'):>2}  "
              f"TMA {ptx.count('cp.async.bulk.tensor')}")


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
    kernel = triton_split._mla_decode_merge_kernel
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


if __name__ == "__main__":
    main()
    warp_specialized()
    merge_kernel()
