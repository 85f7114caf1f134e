"""The `triton` backend: the paged MLA decode of `mlaserve.kernels.mla_decode`, dispatched by
its plan.

The name says how it runs, not which kernel: `plan()` asks `plan_mla_decode` for the step's
kernel (`triton_split`, or `gluon_sm90` on sm_90 for 64-row programs), configuration and split
count, from host-side ints only (batch size, the block table's width, the SM count, the page
size, the compute capability), so a step never waits on the device; `kernel_plan.kernel` names
what runs, and `describe_plan()` says it in one line.

For CUDA graphs, `init_graph_buffers()` allocates a static block table, static lengths and a
partial-output workspace big enough for every batch size up to the maximum; `plan_for_capture()`
fixes the split count of a batch size from the longest possible length (any split count is
correct for any lengths), and `plan_for_replay()` only copies the new block table and lengths
into the static buffers, so every pointer a graph holds stays put. `plan_like_graph()` runs an
eager step (the decode rows of a mixed prefill/decode step) on those buffers with a captured
graph's plan: it launches only kernels that capture compiled.
"""

import dataclasses
import functools
import logging
import os
from types import ModuleType

import torch

from mlaserve.attention.base import BackendCapabilities, MLABackend, MLAShape
from mlaserve.kernels.interpreter import patch_triton_interpreter
from mlaserve.kernels.mla_decode.common import GLUON_FP8_ROWS, device_capability
from mlaserve.kernels.mla_decode.plan import (
    MLADecodeConfig,
    MLADecodePlan,
    default_config,
    describe,
    plan_mla_decode,
)

logger = logging.getLogger(__name__)
# Each distinct warning once a process: a model builds its backend once, a kernel sweep once
# per variant and cell.
_warn_once = functools.cache(logger.warning)

# SM count assumed on CPU, where the kernel only runs in Triton's interpreter (tests).
_CPU_NUM_SMS = 4


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def slow_fp8_cache_warning(shape: MLAShape) -> str | None:
    """What to tell a user whose FP8 cache decodes slower than a 16-bit one would: more than
    `GLUON_FP8_ROWS` heads a rank, where the decode converts each FP8 tile before 16-bit
    products instead of reading half the bytes straight into them (None otherwise)."""
    if shape.cache_dtype.itemsize != 1 or shape.num_heads <= GLUON_FP8_ROWS:
        return None
    cache = str(shape.dtype).removeprefix("torch.")
    return (f"decode over the FP8 cache with {shape.num_heads} heads per rank converts each "
            "FP8 tile to 16 bits before its products (the transposed FP8 pass takes at most "
            f"{GLUON_FP8_ROWS} query rows), which is slower than decode over a {cache} cache "
            "at this width (benchmarks/fp8/README.md); the FP8 cache still holds twice the "
            "tokens. For speed, use --kv-cache-dtype auto, or tensor parallelism that leaves "
            f"at most {GLUON_FP8_ROWS} heads per rank")


class TritonMLABackend(MLABackend):
    """Split-KV decode (each KV tile read once for up to 64 query rows, LSE merge) through the
    kernel its plan names: the Triton split pass, or the Gluon pass on sm_90."""

    name = "triton"
    capabilities = BackendCapabilities(
        device_types=("cuda", "cpu"),
        dtypes=(torch.bfloat16, torch.float16, torch.float32),
        fp8_kv_cache=True,
        block_sizes=None,  # any power of two (checked in extra_reasons)
        max_num_heads=128,
        max_q_len=8,
        min_compute_capability=(8, 0),
        supports_cuda_graphs=True,
        graph_lengths_on_device=True,
    )
    auto_priority = 10

    @classmethod
    def extra_reasons(cls, shape: MLAShape) -> list[str]:
        reasons = []
        try:
            import triton  # noqa: F401
        except ImportError:
            reasons.append("triton is not installed")
        if shape.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            reasons.append("needs a CUDA GPU, or TRITON_INTERPRET=1 for the CPU interpreter")
        for name, value in (("kv_lora_rank", shape.kv_lora_rank),
                            ("qk_rope_head_dim", shape.qk_rope_head_dim)):
            if value < 16 or not _is_pow2(value):
                reasons.append(f"{name} {value} is not a power of two >= 16")
        if not _is_pow2(shape.block_size):
            reasons.append(f"block_size {shape.block_size} is not a power of two")
        return reasons

    def __init__(self, shape: MLAShape, softmax_scale: float) -> None:
        super().__init__(shape, softmax_scale)
        if shape.device.type == "cpu":
            patch_triton_interpreter()
            self.num_sms = _CPU_NUM_SMS
        else:
            self.num_sms = torch.cuda.get_device_properties(shape.device).multi_processor_count
        self.capability = device_capability(shape.device)
        warning = slow_fp8_cache_warning(shape)
        if warning and shape.device.type == "cuda":
            _warn_once(warning)
        # A launch configuration to use instead of the per-shape default; field changes applied
        # to the configuration of each plan; a forced split count (`bench kernel --sweep`).
        self.config: MLADecodeConfig | None = None
        self.config_changes: dict[str, object] = {}
        self.num_splits: int | None = None
        self._plans: dict[tuple, MLADecodePlan] = {}
        self._eager_workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._graph_workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        # The step's split length ([1] int32) with balanced splits: planned on the device once
        # a step, read by every layer's split pass (a static buffer under CUDA graphs).
        self.split_len: torch.Tensor | None = None
        self._graph_split_len: torch.Tensor | None = None

    @property
    def _kernels(self) -> ModuleType:
        from mlaserve.kernels.mla_decode import launch  # imports triton, which may be missing

        return launch

    def _make_plan(self, batch_size: int, max_seq_len: int, q_len: int) -> MLADecodePlan:
        """The kernel plan for a batch (memoised: planning is pure in these ints and the config)."""
        changes = tuple(sorted(self.config_changes.items()))
        key = (batch_size, max_seq_len, q_len, self.config, changes, self.num_splits)
        plan = self._plans.get(key)
        if plan is None:
            shape = self.shape
            config = self.config
            if changes:
                config = dataclasses.replace(config or default_config(
                    shape.num_heads, q_len, shape.kv_lora_rank, shape.qk_rope_head_dim,
                    shape.dtype, batch_size, max_seq_len, shape.block_size,
                    shape.kv_cache_dtype), **dict(changes))
            plan = plan_mla_decode(
                batch_size, max_seq_len, shape.num_heads, q_len, shape.kv_lora_rank,
                shape.qk_rope_head_dim, shape.dtype, self.num_sms, shape.block_size,
                config=config, num_splits=self.num_splits, capability=self.capability,
                kv_cache_dtype=shape.kv_cache_dtype)
            self._plans[key] = plan
        return plan

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int = 1,
             max_seq_len: int | None = None) -> None:
        """Prepare one step; see `MLABackend.plan`.

        Args:
            max_seq_len: optional host-side bound on `seq_lens` (tighter bounds give better split
                counts); defaults to block_table.shape[1] * block_size. Never read from the device.
        """
        batch, width = block_table.shape
        bound = width * self.shape.block_size if max_seq_len is None else max_seq_len
        plan = self._make_plan(batch, bound, q_len)
        need_o, need_lse = plan.workspace_o_numel, plan.workspace_lse_numel
        workspace = self._eager_workspace
        if workspace is None or workspace[0].numel() < need_o or workspace[1].numel() < need_lse:
            have_o, have_lse = (0, 0) if workspace is None else (w.numel() for w in workspace)
            device = self.shape.device
            workspace = (torch.empty(max(need_o, have_o), dtype=torch.float32, device=device),
                         torch.empty(max(need_lse, have_lse), dtype=torch.float32, device=device))
            self._eager_workspace = workspace
        self._set_step(block_table, seq_lens, q_len, plan, workspace)
        if plan.split_slots:
            self.split_len = self._kernels.plan_split_len(plan, seq_lens.to(torch.int32))

    def _set_step(self, block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int,
                  plan: MLADecodePlan, workspace: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.block_table = block_table
        self.seq_lens = seq_lens
        self.q_len = q_len
        self.kernel_plan = plan
        self.workspace = workspace

    def describe_plan(self) -> str:
        """The kernel and configuration the current step's plan runs, in one line."""
        return describe(self.kernel_plan)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, return_lse: bool = False
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        plan = self.kernel_plan
        o, lse = self._kernels.mla_decode_triton(
            q, kv_cache, self.block_table, self.seq_lens, self.softmax_scale,
            self.shape.kv_lora_rank, self.q_len, plan, workspace=self.workspace,
            split_len=self.split_len if plan.split_slots else None)
        return (o, lse) if return_lse else o

    # CUDA-graph hooks: static block table, lengths and workspace; a fixed split count per
    # captured batch size, planned for the longest length the static block table can hold.
    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        super().init_graph_buffers(max_batch_size, max_blocks_per_seq)
        self._graph_max_seq_len = max_blocks_per_seq * self.shape.block_size
        need_o = need_lse = 0
        for batch in range(1, max_batch_size + 1):
            for q_len in range(1, self.shape.max_q_len + 1):
                plan = self._make_plan(batch, self._graph_max_seq_len, q_len)
                need_o = max(need_o, plan.workspace_o_numel)
                need_lse = max(need_lse, plan.workspace_lse_numel)
        device = self.shape.device
        self._graph_workspace = (torch.empty(need_o, dtype=torch.float32, device=device),
                                 torch.empty(need_lse, dtype=torch.float32, device=device))
        self._graph_split_len = torch.zeros(1, dtype=torch.int32, device=device)

    def _plan_static(self, batch_size: int, q_len: int) -> None:
        if self._graph_workspace is None:
            raise RuntimeError("init_graph_buffers() must be called before planning for graphs")
        plan = self._make_plan(batch_size, self._graph_max_seq_len, q_len)
        self._set_step(self.graph_block_table[:batch_size], self.graph_seq_lens[:batch_size],
                       q_len, plan, self._graph_workspace)
        self.split_len = self._graph_split_len

    def _plan_graph_split_len(self, batch: int, graph_batch_size: int, q_len: int) -> None:
        """With balanced splits, the step's split length into the static buffer the graphs read
        (outside any graph: once a step, before replay), for the grid of the graph of
        graph_batch_size that runs the step's `batch` requests."""
        plan = self._make_plan(graph_batch_size, self._graph_max_seq_len, q_len)
        if plan.split_slots:
            self._kernels.plan_split_len(plan, self.graph_seq_lens[:batch],
                                         out=self._graph_split_len)

    def plan_for_capture(self, batch_size: int, q_len: int = 1) -> None:
        self._plan_static(batch_size, q_len)

    def set_graph_lengths(self, seq_lens: torch.Tensor) -> None:
        super().set_graph_lengths(seq_lens)  # and with balanced splits, their split length
        batch = seq_lens.shape[0]
        self._plan_graph_split_len(batch, batch, self.q_len)

    def plan_like_graph(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        graph_batch_size: int, q_len: int = 1) -> None:
        # The captured graph's plan, the static block table (its row stride) and workspace: the
        # same compiled kernels; the grid covers the B rows only.
        MLABackend.plan_for_replay(self, block_table, seq_lens, q_len)
        batch = block_table.shape[0]
        plan = self._make_plan(graph_batch_size, self._graph_max_seq_len, q_len)
        self._set_step(self.graph_block_table[:batch], self.graph_seq_lens[:batch], q_len, plan,
                       self._graph_workspace)
        self.split_len = self._graph_split_len
        self._plan_graph_split_len(batch, graph_batch_size, q_len)

    def plan_for_replay(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        q_len: int = 1, graph_batch_size: int | None = None) -> None:
        super().plan_for_replay(block_table, seq_lens, q_len)
        batch = block_table.shape[0]
        self._plan_static(batch, q_len)
        self._plan_graph_split_len(batch, graph_batch_size or batch, q_len)
