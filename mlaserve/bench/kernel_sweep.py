"""`mlaserve bench kernel --sweep`: variants of the triton backend's plan, gated and timed beside
the plan's own choice in the same run.

A sweep spec is groups of `field=value,value,...` separated by spaces or ';'; the variants are
the product of the groups. A field is one of `MLADecodeConfig`'s (block_m, block_n, num_warps,
num_stages, split_policy, balanced_splits, programs_per_sm, min_split_len, max_num_splits,
merge_block_rows, merge_num_warps, programmatic_launch, tma_loads, warp_specialized,
partial_dtype, ...), changed in the configuration the plan would choose for each cell, or
`num_splits` (a forced split count). Each
variant is a backend row named `triton[field=value,...]`; like every row it is checked against
the float32 reference before it is timed, and the kernel and configuration its plan ran are
printed under the cell. Example:

    mlaserve bench kernel --backends triton,flashinfer --heads 16 --batch-sizes 64 \\
        --kv-lens 1024 --sweep "block_n=32,64 num_stages=2,3"
"""

import dataclasses
import itertools

from mlaserve.attention.base import MLABackend
from mlaserve.kernels.mla_decode.plan import MLADecodeConfig

SWEPT_BACKEND = "triton"
_FIELD_TYPES: dict[str, type] = {f.name: f.type for f in dataclasses.fields(MLADecodeConfig)}
_FIELD_TYPES["num_splits"] = int
Changes = dict[str, int | float | str | bool]


def _value(field: str, text: str) -> int | float | str | bool:
    kind = _FIELD_TYPES[field]
    if kind is bool:
        if text.lower() not in ("0", "1", "true", "false"):
            raise ValueError(f"--sweep {field}: expected 0/1/true/false, got {text!r}")
        return text.lower() in ("1", "true")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"--sweep {field}: expected {kind.__name__}, got {text!r}") from None


def parse_sweep(spec: str) -> list[Changes]:
    """'block_n=32,64 num_stages=2,3' -> one dict of field changes per variant (the product)."""
    groups = []
    for group in spec.replace(";", " ").split():
        field, _, values = group.partition("=")
        if field not in _FIELD_TYPES:
            raise ValueError(f"--sweep: unknown field {field!r}; choose from "
                             f"{', '.join(_FIELD_TYPES)}")
        parsed = [_value(field, v) for v in values.split(",") if v.strip()]
        if not parsed:
            raise ValueError(f"--sweep {field}: no values")
        groups.append([(field, v) for v in dict.fromkeys(parsed)])
    if not groups:
        raise ValueError("--sweep is empty")
    return [dict(combo) for combo in itertools.product(*groups)]


def variant_name(changes: Changes) -> str:
    """The backend row name of a variant: triton[block_n=32,num_splits=4]."""
    return f"{SWEPT_BACKEND}[{','.join(f'{k}={v}' for k, v in changes.items())}]"


def split_variant(name: str) -> tuple[str, Changes]:
    """'triton[block_n=32,num_splits=4]' -> ('triton', {...}); a plain name -> (name, {})."""
    if not name.endswith("]") or "[" not in name:
        return name, {}
    base, _, inside = name[:-1].partition("[")
    return base, {field: _value(field, value) for field, _, value in
                  (item.partition("=") for item in inside.split(","))}


def apply_variant(backend: MLABackend, changes: Changes) -> None:
    """Make `backend` (the triton backend) plan every step with `changes`."""
    changes = dict(changes)
    backend.num_splits = changes.pop("num_splits", None)
    backend.config_changes = changes
