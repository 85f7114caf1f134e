"""What `gpu_kernel_sweep.py` measures: the shapes, the tile and split-policy candidates per
shape, configuration names, and the FlashInfer fa3 times it prints for scale.

The sweep itself (building inputs, checking, timing, reporting) is in gpu_kernel_sweep.py.
"""

import dataclasses
import sys
from pathlib import Path
from typing import Protocol

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlaserve.bench.kernel_grid import Cell  # noqa: E402
from mlaserve.kernels import mla_decode_plan as planning  # noqa: E402
from mlaserve.kernels.mla_decode_plan import MLADecodeConfig  # noqa: E402


class SweepSettings(Protocol):
    """What the candidate lists read from the running sweep (`gpu_kernel_sweep.Sweep`)."""

    smoke: bool
    dtype: torch.dtype
    kv_lora_rank: int
    rope_dim: int
    head_dim: int

    def plan(self, shape: "Shape", config: MLADecodeConfig | None) -> planning.MLADecodePlan:
        ...


# FlashInfer fa3 under graph replay on the same GPU model, measured earlier (2026-12-02):
# (heads, batch, kv_len, block_size, q_len) -> µs.
FA3_ANCHOR_US = {
    (16, 1, 1024, 64, 1): 15.4, (16, 1, 8192, 64, 1): 22.5, (16, 64, 1024, 64, 1): 29.4,
    (16, 64, 4096, 64, 1): 82.9, (16, 512, 1024, 64, 1): 167.5, (16, 512, 4096, 64, 1): 652.8,
    (16, 512, 4096, 32, 1): 637.7, (128, 1, 1024, 64, 1): 13.4, (128, 1, 8192, 64, 1): 22.8,
    (128, 64, 1024, 64, 1): 41.9, (128, 64, 4096, 64, 1): 144.9, (128, 512, 1024, 64, 1): 317.4,
    (128, 512, 4096, 64, 1): 1204.3, (16, 64, 4096, 64, 2): 89.9, (16, 64, 4096, 64, 4): 96.0,
    (16, 512, 4096, 64, 2): 670.8, (128, 64, 4096, 64, 2): 279.0, (16, 8, 32768, 64, 1): 85.3,
    (128, 8, 32768, 64, 1): 157.3,
}
SMEM_LIMIT = 227 * 1024

@dataclasses.dataclass(frozen=True)
class Shape:
    num_heads: int
    batch: int
    kv_len: int
    block_size: int
    q_len: int

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        return (self.num_heads, self.batch, self.kv_len, self.block_size, self.q_len)

    @property
    def cell(self) -> Cell:
        return Cell(self.num_heads, self.batch, self.kv_len, self.block_size, self.q_len)

    def __str__(self) -> str:
        return (f"H{self.num_heads} B{self.batch} kv{self.kv_len} blk{self.block_size} "
                f"q{self.q_len}")



def correctness_shapes(smoke: bool) -> list[Shape]:
    if smoke:
        cells = [(1, 40), (3, 100)]
        return [Shape(h, b, kv, 16, q) for q in (1, 2) for h in (16,) for b, kv in cells]
    cells = [(1, 1024), (1, 4096), (1, 8192), (64, 1024), (64, 4096), (512, 1024), (512, 4096)]
    return [Shape(h, b, kv, blk, q) for blk in (64, 32) for b, kv in cells
            for h in (16, 128) for q in (1, 2, 4)]


def timing_shapes(smoke: bool) -> list[Shape]:
    """Most informative first: the budget may end the sweep before the last ones."""
    if smoke:
        return [Shape(16, 1, 100, 16, 1), Shape(16, 3, 40, 16, 2)]
    first = [(64, 4096), (512, 4096), (1, 8192), (64, 1024), (512, 1024), (1, 1024), (1, 4096)]
    shapes = [Shape(h, b, kv, 64, 1) for b, kv in first for h in (16, 128)]
    shapes += [Shape(16, 64, 4096, 64, 2), Shape(16, 64, 4096, 64, 4),
               Shape(16, 512, 4096, 64, 2), Shape(128, 64, 4096, 64, 2),
               Shape(16, 512, 4096, 32, 1), Shape(16, 8, 32768, 64, 1),
               Shape(128, 8, 32768, 64, 1)]
    return shapes


def tile_candidates(sweep: SweepSettings, shape: Shape) -> list[MLADecodeConfig]:
    """Tile configurations for the shape's regime; the default first; shared-memory filtered."""
    rows = shape.q_len * shape.num_heads
    max_len = (-(-shape.kv_len // shape.block_size) + 1) * shape.block_size
    default = planning.default_config(shape.num_heads, shape.q_len, sweep.kv_lora_rank,
                                     sweep.rope_dim, sweep.dtype, shape.batch, max_len,
                                     shape.block_size)
    if rows <= 16:
        tiles = [(16, 64, 4, 2), (16, 32, 4, 2), (16, 32, 4, 3), (16, 32, 4, 4), (16, 64, 8, 2),
                 (64, 32, 8, 2)]
    # 32-row groups with 8 warps: 176 registers and no stack on sm_90, against 255 and an 8-byte
    # spill with 4 (scripts/kernel_resources.py)
    elif rows <= 64:
        tiles = [(64, 32, 8, 2), (64, 32, 8, 3), (32, 32, 4, 2), (32, 64, 4, 2), (32, 64, 8, 2),
                 (16, 64, 4, 2)]
    else:
        tiles = [(64, 32, 8, 2), (64, 32, 8, 3), (64, 16, 8, 3), (64, 16, 8, 4), (64, 64, 8, 2),
                 (32, 32, 4, 2), (32, 64, 4, 2), (32, 64, 8, 2)]
    if sweep.smoke:
        tiles = [(16, 16, 4, 2), (16, 32, 4, 2)]
    out = [default]
    for block_m, block_n, num_warps, num_stages in tiles:
        smem = (block_m + num_stages * block_n) * sweep.head_dim * 2 + block_m * block_n * 2
        config = dataclasses.replace(default, block_m=block_m, block_n=block_n,
                                     num_warps=num_warps, num_stages=num_stages,
                                     min_split_len=max(default.min_split_len, 2 * block_n))
        if smem <= SMEM_LIMIT and config not in out:
            out.append(config)
    return out


SPLIT_POLICIES = [  # (name, split_policy, programs_per_sm, min_split_len scale)
    ("waves-1", "waves", 1.0, 1.0), ("waves-2", "waves", 2.0, 1.0),
    ("fill-1", "fill", 1.0, 1.0), ("fill-2", "fill", 2.0, 1.0), ("fill-4", "fill", 4.0, 1.0),
    ("waves-1-short", "waves", 1.0, 0.5), ("fill-2-short", "fill", 2.0, 0.5),
    ("waves-1-long", "waves", 1.0, 2.0),
]


def config_name(config: MLADecodeConfig, num_splits: int) -> str:
    return (f"m{config.block_m} n{config.block_n} w{config.num_warps} s{config.num_stages} "
            f"{config.split_policy}{config.programs_per_sm:g} min{config.min_split_len} "
            f"splits{num_splits}")



def split_candidates(sweep: SweepSettings, shape: Shape, best: MLADecodeConfig
                     ) -> tuple[list[MLADecodeConfig], list[str]]:
    """The best tile under each split policy, one per distinct split count."""
    configs, names, seen = [], [], {}
    for name, policy, per_sm, scale in SPLIT_POLICIES:
        config = dataclasses.replace(
            best, split_policy=policy, programs_per_sm=per_sm,
            min_split_len=max(best.block_n, int(best.min_split_len * scale)))
        splits = sweep.plan(shape, config).num_splits
        if splits in seen:
            names[seen[splits]] += f",{name}"
            continue
        seen[splits] = len(configs)
        configs.append(config)
        names.append(name)
    return configs, names
