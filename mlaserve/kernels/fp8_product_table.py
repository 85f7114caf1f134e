"""Which block-FP8 product each Linear shape runs, measured once on this GPU.

No one product is fastest everywhere (`benchmarks/fp8/README.md`, "DeepGEMM beside the other
block-FP8 products": DeepGEMM wins most cells and loses badly on a few, cuBLASLt and the Gluon
kernel win others, the weight-only product is the one that reads x as it is), so the choice is
measured, per weight shape [N, K] and per bucket of rows M, when a model with block-FP8 Linears
loads on a GPU:

    table[(N, K)] = ((M_1, path_1), (M_2, path_2), ...)     M_1 < M_2 < ... (ROW_BUCKETS)

x of M rows runs the path of the first bucket with M_i >= M (the last one past it). Each
candidate (`candidate_paths`) is timed on random operands of the bucket's rows under CUDA-graph
replay with L2-cold weights, the w8a8 products on x quantized beforehand (their producers
quantize it, `fp8_linear.takes_quantized_input`) or, for the shapes whose layer gets x in the
model dtype (`fp8_linear.unquantized_input_shapes`: o_proj, eh_proj), with the quantization
launch they then pay; the weight-only product on x as it is. A candidate that fails on a shape
is no candidate there.

A faster product must change nothing but speed, and two products round differently, so a
choice left to timing noise would change outputs between runs: the table is measured once per
GPU model and set of shapes, written to the cache directory (`table_path`), and read from there
by every later run (`fp8_product_choice.load_or_measure`, which measures). `install` makes it
the process's table; `fp8_gemm.linear_product_path` obeys it for the shapes it has and keeps its
rules for others. This module holds the table only and imports no kernel.
"""

import json
from dataclasses import dataclass

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

Shape = tuple[int, int]  # (N, K) of a weight [N, K]


@dataclass(frozen=True)
class ProductTable:
    """The measured path per shape and row bucket (see the module docstring)."""

    device_name: str
    paths: dict[Shape, tuple[tuple[int, str], ...]]

    def path(self, rows: int, out_features: int, in_features: int) -> str | None:
        """The product for x [rows, K] and a weight [N, K], or None for a shape not measured."""
        buckets = self.paths.get((out_features, in_features))
        if not buckets:
            return None
        for max_rows, path in buckets:
            if rows <= max_rows:
                return path
        return buckets[-1][1]

    def to_json(self) -> str:
        return json.dumps({"device_name": self.device_name, "paths": [
            {"shape": list(shape), "buckets": [list(b) for b in buckets]}
            for shape, buckets in sorted(self.paths.items())]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ProductTable":
        data = json.loads(text)
        return cls(data["device_name"], {
            tuple(entry["shape"]): tuple((int(m), str(p)) for m, p in entry["buckets"])
            for entry in data["paths"]})


_installed: ProductTable | None = None


def install(table: ProductTable) -> None:
    """Add `table`'s shapes to the process's table (a model loaded later adds its own)."""
    global _installed
    if _installed is not None:
        table = ProductTable(table.device_name, {**_installed.paths, **table.paths})
    _installed = table


def uninstall() -> None:
    """Back to the rules of `fp8_gemm.product_path` alone."""
    global _installed
    _installed = None


def installed() -> ProductTable | None:
    return _installed
