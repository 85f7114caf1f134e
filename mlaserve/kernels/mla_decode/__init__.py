"""Paged MLA decode kernels (docs/architecture.md, "Contracts"): the plan decides, the kernels obey.

- `plan.py`: `plan_mla_decode` maps (shape, device, lengths, page size) to a named split-pass
  kernel, its configuration (from `tuning.py`, the tuned table), the split count and workspace
  sizes; host-side ints only, no Triton.
- `common.py`: the kernel names, constants, host-side split arithmetic and `SplitPassIO`, what
  every split pass takes; `splits.py`: the same arithmetic on the device, shared by the passes.
- `launch.py`: `mla_decode_triton`, which checks the inputs and launches what the plan names:
  the module of the kernel's name, its `launch_split_pass(plan, io)`.
- `triton_split.py`: the Triton split pass, `merge.py`: the log-sum-exp merge kernel (any GPU,
  and the CPU interpreter); `gluon_sm90.py` (+ `gluon_sm90_tiles.py`): the warp-specialised
  sm_90 split pass; `gluon_sm90_fp8.py`: the sm_90 split pass over FP8 caches (16 rows, pages
  of 32 tokens); `gluon_sm90_fp8_transposed.py` (+ `gluon_sm90_fp8_operands.py`): the same
  problem with both products transposed, the FP8 default on pages of 64 or more;
  `gluon_sm90_aot.py`: compiling the Gluon passes for sm_90 without a GPU.

Importing this package imports no Triton: the plan lives here, the kernels in their modules.
"""

from mlaserve.kernels.mla_decode.common import GLUON_SM90, GLUON_SM90_FP8, KERNELS, TRITON_SPLIT
from mlaserve.kernels.mla_decode.plan import (
    MLADecodeConfig,
    MLADecodePlan,
    alloc_workspace,
    default_config,
    describe,
    plan_mla_decode,
)

__all__ = ["GLUON_SM90", "GLUON_SM90_FP8", "KERNELS", "TRITON_SPLIT", "MLADecodeConfig",
           "MLADecodePlan", "alloc_workspace", "default_config", "describe", "plan_mla_decode"]
