"""Measuring the block-FP8 product table (`fp8_product_table`): the candidates of a shape, the
fastest of them per row bucket, and the table cached per GPU model and set of shapes so that
every run after the first reads the same choice (see `fp8_product_table`'s docstring)."""

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from mlaserve.kernels.fp8_product_table import ROW_BUCKETS, ProductTable, Shape

logger = logging.getLogger(__name__)
WEIGHT_ONLY_MAX_BUCKET = 64  # past this the weight-only product is never close
CACHE_ENV = "MLASERVE_CACHE_DIR"  # default ~/.cache/mlaserve
TABLE_VERSION = 2  # raise when a product changes, so that cached tables are measured again


def candidate_paths(rows: int, out_features: int, in_features: int, *, sm90: bool,
                    deep_gemm: bool) -> list[str]:
    """The products that may run x [rows, K] with a weight [N, K] on this GPU."""
    paths = ["triton"]
    if rows <= WEIGHT_ONLY_MAX_BUCKET:
        paths.append("weight-only")
    if in_features % 512 == 0 and out_features % 16 == 0:
        paths.append("cublas")
    if sm90:
        from mlaserve.kernels.fp8_gemm_sm90 import gluon_gemm_serves  # imports gluon

        if gluon_gemm_serves(rows, out_features, in_features):
            paths.append("gluon")
        if deep_gemm:
            paths.append("deepgemm")
    return paths


def choose(shapes: Iterable[Shape], candidates: Callable[[int, int, int], list[str]],
           seconds: Callable[[str, int, int, int], float | None],
           buckets: tuple[int, ...] = ROW_BUCKETS) -> dict[Shape, tuple[tuple[int, str], ...]]:
    """For each shape and bucket the candidate of the fewest `seconds(path, rows, N, K)`
    (None: it failed there); adjacent buckets with the same path stay separate entries."""
    paths = {}
    for out_features, in_features in sorted(set(shapes)):
        chosen = []
        for rows in buckets:
            timed = {}
            for path in candidates(rows, out_features, in_features):
                time = seconds(path, rows, out_features, in_features)
                if time is not None:
                    timed[path] = time
            if not timed:
                raise RuntimeError(f"no block-FP8 product runs a [{rows}, {in_features}] x "
                                   f"[{out_features}, {in_features}]^T product here")
            chosen.append((rows, min(timed, key=timed.get)))
        paths[(out_features, in_features)] = tuple(chosen)
    return paths


def measure(shapes: Iterable[Shape], device: torch.device, repeats: int = 10,
            unquantized_inputs: Iterable[Shape] = ()) -> ProductTable:
    """Time every candidate of every shape and bucket on `device` (an sm_90 GPU or another
    CUDA GPU) and keep the fastest. The w8a8 candidates of `unquantized_inputs` (shapes whose
    layer gets its input in the model dtype: no producer quantizes it) are timed with the
    activation quantization they then pay; the others on x quantized beforehand."""
    with_quantization = set(unquantized_inputs)
    from mlaserve.kernels.fp8_activations import quantize_activations
    from mlaserve.kernels.fp8_blocks import QuantizedActivations, quantize_block_fp8
    from mlaserve.kernels.fp8_gemm import block_fp8_w8a8, fp8_weight_only_matmul
    from mlaserve.kernels.fp8_gemm_common import is_sm90
    from mlaserve.kernels.fp8_gemm_deepgemm import load_deep_gemm
    from mlaserve.kernels.testing import graph_replay_seconds, l2_cold_copies

    sm90, deep_gemm = is_sm90(device), load_deep_gemm() is not None
    weights: dict[Shape, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def operands(out_features: int, in_features: int) -> tuple[list[torch.Tensor],
                                                                 torch.Tensor]:
        if (out_features, in_features) not in weights:
            weights.clear()  # one shape's copies at a time
            w = torch.randn(out_features, in_features, device=device) * 0.02
            w_fp8, w_scales = quantize_block_fp8(w)
            weights[(out_features, in_features)] = (l2_cold_copies(w_fp8), w_scales)
        return weights[(out_features, in_features)]

    def seconds(path: str, rows: int, out_features: int, in_features: int) -> float | None:
        w_fp8s, w_scales = operands(out_features, in_features)
        x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
        if path == "weight-only":
            calls = [lambda w=w: fp8_weight_only_matmul(x, w, w_scales) for w in w_fp8s]
        elif (out_features, in_features) in with_quantization:
            calls = [lambda w=w: block_fp8_w8a8(QuantizedActivations(
                *quantize_activations(x), x.dtype), w, w_scales, path) for w in w_fp8s]
        else:
            xq = QuantizedActivations(*quantize_activations(x), x.dtype)
            calls = [lambda w=w: block_fp8_w8a8(xq, w, w_scales, path) for w in w_fp8s]
        try:
            calls[0]()
            return graph_replay_seconds(calls, repeats, calls_per_graph=8)
        except (RuntimeError, ValueError, NotImplementedError):
            return None

    paths = choose(shapes, lambda m, n, k: candidate_paths(m, n, k, sm90=sm90,
                                                           deep_gemm=deep_gemm), seconds)
    weights.clear()
    torch.cuda.empty_cache()
    return ProductTable(torch.cuda.get_device_name(device), paths)


def table_path(device_name: str, shapes: Iterable[Shape], deep_gemm: bool,
               unquantized_inputs: Iterable[Shape] = ()) -> Path:
    """Where the table of these shapes on this GPU model (with DeepGEMM or without) is kept;
    TABLE_VERSION changes with the products, so an older table is not read."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlaserve")
    key = hashlib.sha256(json.dumps([TABLE_VERSION, device_name, deep_gemm,
                                     sorted(set(shapes)),
                                     sorted(set(unquantized_inputs))]).encode()).hexdigest()
    return root / "fp8-products" / f"{key[:24]}.json"


def load_or_measure(shapes: Iterable[Shape], device: torch.device,
                    unquantized_inputs: Iterable[Shape] = ()) -> ProductTable:
    """The cached table of these shapes on this GPU model, else a measured one (then
    cached; a minute or more the first time, DeepGEMM compiling its kernels); a cache that
    cannot be read or written is measured again, not an error. `unquantized_inputs`: as in
    `measure`."""
    from mlaserve.kernels.fp8_gemm_deepgemm import load_deep_gemm

    shapes, unquantized_inputs = sorted(set(shapes)), sorted(set(unquantized_inputs))
    path = table_path(torch.cuda.get_device_name(device), shapes, load_deep_gemm() is not None,
                      unquantized_inputs)
    try:
        return ProductTable.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        pass
    logger.info("measuring the block-FP8 products of %d weight shapes on this GPU (once; "
                "kept in %s)", len(shapes), path)
    table = measure(shapes, device, unquantized_inputs=unquantized_inputs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table.to_json() + "\n")
    except OSError:
        pass
    return table
