"""The decode-kernel package's shape (issue 23): no two of its modules import each other, the plan
imports no Triton, and the launcher obeys the plan (it raises where the tensors cannot serve the
kernel the plan named, instead of choosing another)."""

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mlaserve.kernels.mla_decode as package
from mlaserve.kernels.mla_decode.common import GLUON_SM90
from mlaserve.kernels.mla_decode.plan import plan_mla_decode

PACKAGE = Path(package.__file__).parent


def _imports(path: Path) -> set[str]:
    """The package modules a file imports (module names inside mlaserve.kernels.mla_decode)."""
    prefix = "mlaserve.kernels.mla_decode"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix):
            if node.module == prefix:
                found |= {alias.name for alias in node.names}
            else:
                found.add(node.module.removeprefix(prefix + "."))
    return found - {"__init__"}


def test_no_import_cycles_between_kernel_modules():
    graph = {path.stem: _imports(path) for path in PACKAGE.glob("*.py")
             if path.stem != "__init__"}
    assert set().union(*graph.values()) <= set(graph)

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt}))
                   for nxt in graph[start])

    assert not [name for name in graph if reaches(name, name, {name})]
    assert "gluon_sm90" not in graph["triton_split"] and "triton_split" not in graph["gluon_sm90"]


def test_the_plan_imports_no_triton():
    code = ("import sys; import mlaserve.kernels.mla_decode.plan, mlaserve.kernels.mla_decode; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_the_launcher_obeys_the_plan():
    pytest.importorskip("triton")
    from mlaserve.kernels.mla_decode.launch import mla_decode_triton

    q = torch.randn(2, 16, 576, dtype=torch.bfloat16)
    pool = torch.randn(16, 64, 576, dtype=torch.bfloat16)
    kv_cache = pool[::2]  # [8, 64, 576] with pages not back to back (a page's gap after each)
    table = torch.arange(4, dtype=torch.int32).view(2, 2)
    lens = torch.tensor([100, 7], dtype=torch.int32)
    plan = plan_mla_decode(2, 128, 16, 1, 512, 64, torch.bfloat16, 132, 64,
                           capability=(9, 0))
    gluon = dataclasses.replace(plan, kernel=GLUON_SM90)
    with pytest.raises(ValueError, match="gluon_sm90 kernel needs kv_cache pages back to back"):
        mla_decode_triton(q, kv_cache, table, lens, 0.1, 512, 1, gluon)
    tma = dataclasses.replace(plan, kernel="triton_split", tma_loads=True)
    with pytest.raises(ValueError, match="triton_split kernel with TMA loads needs"):
        mla_decode_triton(q, kv_cache, table, lens, 0.1, 512, 1, tma)
