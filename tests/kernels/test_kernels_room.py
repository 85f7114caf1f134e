"""docs/architecture.md's rule for `mlaserve/kernels/` ("Floors"): pure tensor functions that
import nothing else from mlaserve (so the model, the engine and the benchmarks may use any
kernel, and no kernel drags in the model package)."""

import ast
from pathlib import Path

import mlaserve.kernels as kernels


def _mlaserve_imports(path: Path) -> set[str]:
    """The mlaserve modules a file imports, at any depth in the file (lazy imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name == "mlaserve" or name.startswith("mlaserve.")}


def test_kernels_import_only_kernels() -> None:
    root = Path(kernels.__file__).parent
    outside = {str(path.relative_to(root)): sorted(
                   name for name in _mlaserve_imports(path)
                   if not name.startswith("mlaserve.kernels"))
               for path in root.rglob("*.py")}
    assert {path: names for path, names in outside.items() if names} == {}
