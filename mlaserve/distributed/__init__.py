"""torch.distributed process groups and the tensor-parallel collectives the model layers use.

Below `model` and `engine` (the parallel layers import this, never the engine). Tensor parallel
size 1, the default, needs no torch.distributed at all.
"""

from mlaserve.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    get_tp_group,
    init_tensor_parallel,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "TensorParallelGroup",
    "destroy_tensor_parallel",
    "get_tp_group",
    "init_tensor_parallel",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
