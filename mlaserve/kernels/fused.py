"""Whether an op runs as its fused Triton kernel or as the torch code that states its semantics:
decided in one place, `use_fused_kernels`. The kernels run on CUDA tensors; CPU tensors take
the torch code, except inside `force_fused_kernels()`, where tests run the kernels on the CPU in
Triton's interpreter (TRITON_INTERPRET=1).
"""

import contextlib
from collections.abc import Iterator

import torch

_fused_on_cpu = False


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether ops on x run as the fused Triton kernels: on CUDA tensors, or on CPU tensors
    inside `force_fused_kernels()`; otherwise the torch code runs."""
    return x.is_cuda or _fused_on_cpu


@contextlib.contextmanager
def force_fused_kernels() -> Iterator[None]:
    """Run the fused kernels on CPU tensors too (in Triton's interpreter: TRITON_INTERPRET=1)."""
    global _fused_on_cpu
    previous, _fused_on_cpu = _fused_on_cpu, True
    try:
        yield
    finally:
        _fused_on_cpu = previous
