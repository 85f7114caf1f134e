"""The operations a step launches on a GPU one by one (`mlaserve bench step --host-only
--count-kernels`), counted on the CPU: every torch operation that is not a view, outside the
replays of the CUDA-graph stand-ins (`engine/graph_standins.py`), each replay one launch."""

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlaserve.engine.graph_standins import EagerReplay


def launches_kernel(func: torch._ops.OpOverload, args: tuple, kwargs: dict,
                    out: object) -> bool:
    """Whether a GPU runs a kernel (or a copy) for this call: not for a view, nor for a
    conversion that returns its input; a move to a device (a no-op on the CPU) counts."""
    name = func._schema.name
    if name == "aten::to":
        return out is not args[0] or "device" in kwargs
    return not func.is_view and name != "aten::detach_"


class _LaunchCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.replays = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not EagerReplay.replaying and launches_kernel(func, args, kwargs, out):
            self.counts[func._schema.name.removeprefix("aten::")] += 1
        return out


def count_launches(step: Callable[[], object], steps: int) -> Counter[str]:
    """Launches by operation name over `steps` calls of step(), graph replays as
    'graph replay'."""
    replay = EagerReplay.replay
    counter = _LaunchCounter()

    def counted_replay(self: EagerReplay) -> None:
        counter.counts["graph replay"] += 1
        replay(self)

    EagerReplay.replay = counted_replay
    try:
        with counter:
            for _ in range(steps):
                step()
    finally:
        EagerReplay.replay = replay
    return counter.counts
