"""Compile one of the Gluon kernels for sm_90 without a GPU (the split passes through
`gluon_sm90_aot`, the FP8 GEMM through `fp8_gemm_sm90.compile_for_sm90`), in a fresh
interpreter: the CPU test session interprets Triton kernels (TRITON_INTERPRET=1 is read when
triton and gluon decorate their functions)."""

import json
import os
import subprocess
import sys

_SCRIPT = """
import json, os, subprocess, sys, tempfile
import importlib, torch, triton
module, function = sys.argv[1].split(":")
kwargs = json.loads(sys.argv[2])
for name in ("dtype", "out_dtype"):
    if name in kwargs:
        kwargs[name] = getattr(torch, kwargs[name])
compiled = getattr(importlib.import_module(module), function)(**kwargs)
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
with tempfile.TemporaryDirectory() as tmp:
    cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
    open(cubin, "wb").write(compiled.asm["cubin"])
    open(ptx, "w").write(compiled.asm["ptx"])
    usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", cubin],
                           capture_output=True, text=True, check=True).stdout
    # ptxas's notes on the same PTX (e.g. wgmma serialised, C7510-C7520)
    notes = subprocess.run([os.path.join(bin_dir, "ptxas"), "--gpu-name", "sm_90a", "-v", ptx,
                            "-o", os.path.join(tmp, "again.cubin")],
                           capture_output=True, text=True, check=True).stderr
line = next(line for line in usage.splitlines() if "STACK:" in line)
print(json.dumps({"stack": int(line.split("STACK:")[1].split()[0]),
                  "shared": compiled.metadata.shared, "ptx": compiled.asm["ptx"],
                  "ptxas_notes": notes}))
"""


def compile_sm90(function: str, module: str = "mlaserve.kernels.mla_decode.gluon_sm90_aot",
                 **kwargs) -> dict:
    """`module.function(**kwargs)` (a dtype given by its torch name): the stack bytes (> 0:
    register spills), the shared memory and the PTX of the compiled kernel, and ptxas's notes
    on that PTX (`ptxas_notes`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, f"{module}:{function}",
                          json.dumps(kwargs)],
                         capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.splitlines()[-1])
