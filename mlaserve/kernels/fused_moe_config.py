"""The fused MoE's launch configuration (`fused_moe.py`'s kernels obey it): the tiles of its two
GEMM kernels and their row blocks, from a tuned file of this GPU model where one exists, else
from a heuristic. Chosen on the host per call, from the routed pairs T * K."""

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mlaserve.kernels.fp8_blocks import FP8_DTYPE


@dataclass(frozen=True)
class GemmTiles:
    """Tiles and launch shape of one expert GEMM (N: output columns, K: reduction)."""

    block_n: int  # output columns per program (the gate kernel: gate and up columns each)
    block_k: int
    group_size_m: int  # M-blocks that run next to each other on one N-block (L2 reuse)
    num_warps: int
    num_stages: int
    # Compute each tile transposed, [block_n, block_m] = W x^T: the weight's columns fill the
    # 64 rows Hopper's wgmma needs where block_m is small, and FP8 operands stay FP8 (wgmma
    # reads both K-major from shared memory; x W^T at 16 rows runs mma.sync on operands
    # converted to float16 first: `mlaserve bench kernel-diag resources`)
    swap_ab: bool = False


@dataclass(frozen=True)
class FusedMoEConfig:
    """Launch configuration of `fused_experts_triton`."""

    block_m: int  # rows per program; each expert's run of rows is padded to a multiple
    gate_up: GemmTiles
    down: GemmTiles


# Tuned configurations, one JSON file per expert shape, weight format and GPU model, written by
# `mlaserve bench moe --sweep --configs-dir` (`tuned_config_path` names them): {T * K: config}.
CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"


def weight_format(dtype: torch.dtype) -> str | None:
    """The experts' weight format as the tuned files name it: "16-bit" (bfloat16 and float16
    share tiles), "fp8" (block-FP8), None for float32 (never tuned)."""
    if dtype in (torch.float16, torch.bfloat16):
        return "16-bit"
    return "fp8" if dtype == FP8_DTYPE else None


def tuned_config_path(num_experts: int, hidden: int, inter: int, weights: str,
                      device_name: str, config_dir: Path | None = None) -> Path:
    """The file of tuned configurations for this shape, weight format and GPU model, in
    config_dir (default `CONFIG_DIR`, the files the engine reads)."""
    device = "".join(c if c.isalnum() or c in "-." else "_" for c in device_name)
    name = f"E={num_experts},D={hidden},I={inter},weights={weights},{device}.json"
    return (config_dir or CONFIG_DIR) / name


def config_from_json(entry: dict) -> FusedMoEConfig:
    """A configuration from its `dataclasses.asdict` form."""
    return FusedMoEConfig(block_m=entry["block_m"], gate_up=GemmTiles(**entry["gate_up"]),
                          down=GemmTiles(**entry["down"]))


@functools.cache
def tuned_configs(num_experts: int, hidden: int, inter: int, weights: str | None,
                  device_name: str | None) -> dict[int, FusedMoEConfig]:
    """{T * K: config} from this GPU model's tuned file, read once; empty without one."""
    if weights is None or device_name is None:
        return {}
    path = tuned_config_path(num_experts, hidden, inter, weights, device_name)
    if not path.exists():
        return {}
    return {int(num_pairs): config_from_json(entry)
            for num_pairs, entry in json.loads(path.read_text())["configs"].items()}


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def default_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> FusedMoEConfig:
    """The heuristic for Hopper, from the mean rows per expert m = T * K / E.

    m <= 24 (decode): each expert's weights are read once for a few rows, so the kernels stream
    weights: 16- or 32-row blocks (the smallest that hold a typical expert's rows), 64 columns by
    128-deep K tiles, no grouping (M-blocks are different experts), and as many stages in flight
    as leave room for two programs per SM (3 for the gate kernel's two weight tiles, 4 for down).
    m <= 128: 64-row blocks; above, 128-row blocks with 8 warps; both with 64-deep K tiles and
    8 M-blocks grouped per N-block so an expert's blocks share its weight tiles in L2.
    float32 halves block_k: the same shared memory per stage. FP8 weights take the 16-bit tiles,
    whose block_k divides the 128-wide scale blocks.
    """
    rows_per_expert = num_pairs / num_experts
    depth = 2 if dtype == torch.float32 else 1
    if rows_per_expert <= 24:
        return FusedMoEConfig(
            block_m=16 if rows_per_expert <= 12 else 32,
            gate_up=GemmTiles(block_n=64, block_k=128 // depth, group_size_m=1, num_warps=4,
                              num_stages=3),
            down=GemmTiles(block_n=64, block_k=128 // depth, group_size_m=1, num_warps=4,
                           num_stages=4),
        )
    num_warps = 4 if rows_per_expert <= 128 else 8
    return FusedMoEConfig(
        block_m=64 if rows_per_expert <= 128 else 128,
        gate_up=GemmTiles(block_n=64, block_k=64 // depth, group_size_m=8, num_warps=num_warps,
                          num_stages=4),
        down=GemmTiles(block_n=128, block_k=64 // depth, group_size_m=8, num_warps=num_warps,
                       num_stages=4),
    )


def moe_config(num_pairs: int, num_experts: int, hidden: int, inter: int,
               dtype: torch.dtype, device: torch.device | None = None) -> FusedMoEConfig:
    """The configuration for T * K = num_pairs pairs: the entry nearest in ratio to num_pairs
    of the tuned file for this shape, weight format (dtype: the weights') and device's GPU
    model, else `default_config`."""
    device_name = None
    if device is not None and device.type == "cuda":
        device_name = _device_name(torch.cuda.current_device() if device.index is None
                                   else device.index)
    tuned = tuned_configs(num_experts, hidden, inter, weight_format(dtype), device_name)
    if tuned:
        nearest = min(tuned, key=lambda n: max(n, num_pairs) / min(n, num_pairs))
        return tuned[nearest]
    return default_config(num_pairs, num_experts, dtype)
