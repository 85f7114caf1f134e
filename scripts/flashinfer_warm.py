"""Compile one FlashInfer MLA module ahead of use.

Usage: python3 scripts/flashinfer_warm.py fa3|fa2 bfloat16|float16
"""

import sys

import torch

from mlaserve.attention.base import MLAShape
from mlaserve.attention.flashinfer_backend import FlashInferFA2MLABackend, FlashInferMLABackend

cls = FlashInferFA2MLABackend if sys.argv[1] == "fa2" else FlashInferMLABackend
shape = MLAShape(16, 512, 64, 64, getattr(torch, sys.argv[2]), torch.device("cuda"))
table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
cls(shape, 192 ** -0.5).plan(table, torch.ones(1, dtype=torch.int32, device="cuda"))
print(f"compiled {sys.argv[1]} {sys.argv[2]}")
