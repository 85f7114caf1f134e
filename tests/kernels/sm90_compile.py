"""Compile one of the Gluon split passes for sm_90 without a GPU (`gluon_sm90_aot`), in a fresh
interpreter: the CPU test session interprets Triton kernels (TRITON_INTERPRET=1 is read when
triton and gluon decorate their functions)."""

import json
import os
import subprocess
import sys

_SCRIPT = """
import json, os, subprocess, sys, tempfile
import torch, triton
from mlaserve.kernels.mla_decode import gluon_sm90_aot
kwargs = json.loads(sys.argv[2])
if "dtype" in kwargs:
    kwargs["dtype"] = getattr(torch, kwargs["dtype"])
compiled = getattr(gluon_sm90_aot, sys.argv[1])(**kwargs)
tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(compiled.asm["cubin"]); f.flush()
    usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                           text=True, check=True).stdout
line = next(line for line in usage.splitlines() if "STACK:" in line)
print(json.dumps({"stack": int(line.split("STACK:")[1].split()[0]),
                  "shared": compiled.metadata.shared, "ptx": compiled.asm["ptx"]}))
"""


def compile_sm90(function: str, **kwargs) -> dict:
    """`gluon_sm90_aot.<function>(**kwargs)` (a dtype given by its torch name): the stack bytes
    (> 0: register spills), the shared memory and the PTX of the compiled pass."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, function, json.dumps(kwargs)],
                         capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.splitlines()[-1])
