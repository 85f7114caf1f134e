"""The MLABackend interface: what a paged MLA decode backend declares and does.

A backend is built once per engine for one attention shape. Per engine step the runner calls
`plan()` once with the batch's block table and lengths; every layer then calls `run()`, which only
launches. For CUDA graphs, `init_graph_buffers()` allocates static inputs for a maximum batch,
`plan_for_capture()` plans a batch size before capture, and `plan_for_replay()` refreshes the
static buffers before each replay without changing any pointer the graph holds.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class MLAShape:
    """The attention problem a backend is asked to serve."""

    num_heads: int  # query heads on this rank
    kv_lora_rank: int  # L: width of c_kv and of the latent output
    qk_rope_head_dim: int  # R: width of k_pe
    block_size: int  # tokens per KV page
    dtype: torch.dtype  # q's dtype (and the cache's, unless kv_cache_dtype says otherwise)
    device: torch.device
    max_q_len: int = 1  # new tokens per request in one decode call
    kv_cache_dtype: torch.dtype | None = None  # None or dtype: the same; float8_e4m3fn: FP8

    @property
    def cache_dtype(self) -> torch.dtype:
        """The element type of the latent cache."""
        return self.kv_cache_dtype or self.dtype

    @property
    def head_dim(self) -> int:
        """L + R, the width of one cache row and one absorbed query."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can serve. None means any."""

    device_types: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    fp8_kv_cache: bool = False  # reads a float8_e4m3fn latent cache (queries stay in dtype)
    block_sizes: tuple[int, ...] | None = None
    max_num_heads: int | None = None
    max_q_len: int | None = None
    min_compute_capability: tuple[int, int] | None = None
    supports_cuda_graphs: bool = False
    # its captured kernels read the static lengths when they run, so a graph may set them
    # itself between its passes (`MLABackend.set_graph_lengths`)
    graph_lengths_on_device: bool = False


class UnsupportedShape(ValueError):
    """A backend was built for a shape it cannot serve; `reasons` says why."""

    def __init__(self, backend: str, shape: "MLAShape", reasons: list[str]) -> None:
        super().__init__(f"attention backend '{backend}' cannot serve {shape}: "
                         + "; ".join(reasons))
        self.backend = backend
        self.reasons = reasons


class MLABackend(ABC):
    """One paged MLA decode implementation. Subclasses set `name` and `capabilities`."""

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]
    # Higher is preferred by `auto` among the backends that support a shape.
    auto_priority: ClassVar[int] = 0

    def __init__(self, shape: MLAShape, softmax_scale: float) -> None:
        reasons = self.supports(shape)  # the one check of a backend for a shape
        if reasons:
            raise UnsupportedShape(self.name, shape, reasons)
        self.shape = shape
        self.softmax_scale = softmax_scale

    @classmethod
    def supports(cls, shape: MLAShape) -> list[str]:
        """Reasons this backend cannot serve `shape`; empty when it can."""
        caps = cls.capabilities
        reasons = []
        if shape.device.type not in caps.device_types:
            reasons.append(f"runs on {'/'.join(caps.device_types)}, not {shape.device.type}")
        if shape.dtype not in caps.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in caps.dtypes)
            reasons.append(f"dtype {str(shape.dtype).removeprefix('torch.')} not in ({names})")
        if shape.cache_dtype != shape.dtype and not (
                shape.cache_dtype == torch.float8_e4m3fn and caps.fp8_kv_cache):
            reasons.append(f"cannot read a {str(shape.cache_dtype).removeprefix('torch.')} "
                           "latent cache (use the triton or torch backend, or --kv-cache-dtype "
                           "auto)")
        if caps.block_sizes is not None and shape.block_size not in caps.block_sizes:
            reasons.append(f"block_size {shape.block_size} not in {caps.block_sizes}")
        if caps.max_num_heads is not None and shape.num_heads > caps.max_num_heads:
            reasons.append(f"{shape.num_heads} heads > {caps.max_num_heads}")
        if caps.max_q_len is not None and shape.max_q_len > caps.max_q_len:
            reasons.append(f"q_len {shape.max_q_len} > {caps.max_q_len}")
        if shape.device.type == "cuda" and not torch.cuda.is_available():
            reasons.append("no CUDA GPU is visible")
        elif caps.min_compute_capability is not None and shape.device.type == "cuda":
            capability = torch.cuda.get_device_capability(shape.device)
            if capability < caps.min_compute_capability:
                reasons.append(f"needs compute capability >= {caps.min_compute_capability}, "
                               f"GPU has {capability}")
        return reasons + cls.extra_reasons(shape)

    @classmethod
    def extra_reasons(cls, shape: MLAShape) -> list[str]:
        """Backend-specific reasons beyond the declared capabilities (e.g. a missing package)."""
        return []

    @abstractmethod
    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int = 1) -> None:
        """Prepare one engine step; shared by all layers.

        Args:
            block_table: [B, max_blocks] int32 page ids per request.
            seq_lens: [B] int32 KV length per request including the q_len new tokens.
            q_len: new tokens per request (1 for plain decode).
        """

    def describe_plan(self) -> str:
        """What the last `plan()` chose to run (a kernel and its configuration), in one line;
        the backend's name where it has only one way to run."""
        return self.name

    @abstractmethod
    def run(
        self, q: torch.Tensor, kv_cache: torch.Tensor, return_lse: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend the planned batch for one layer.

        Args:
            q: [B * q_len, H, L + R] absorbed queries, request-major.
            kv_cache: [num_blocks, block_size, L + R] this layer's latent cache.
            return_lse: also return the natural-log LSE.

        Returns:
            o [B * q_len, H, L] in q's dtype, and lse [B * q_len, H] float32 if asked.
        """

    # CUDA-graph hooks. The default keeps static copies of the plan inputs; backends whose plan
    # builds more device state override these.
    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        device = self.shape.device
        self.graph_block_table = torch.zeros(
            max_batch_size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graph_seq_lens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)

    def plan_for_capture(self, batch_size: int, q_len: int = 1) -> None:
        self.plan(self.graph_block_table[:batch_size], self.graph_seq_lens[:batch_size], q_len)

    def plan_like_graph(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        graph_batch_size: int, q_len: int = 1) -> None:
        """Prepare an eager step of B <= graph_batch_size requests as the CUDA graph captured
        for graph_batch_size was planned (e.g. the decode rows of a mixed prefill/decode step),
        so that the step launches only kernels that capture compiled. Arguments as `plan`;
        needs `init_graph_buffers`. Backends whose kernels do not specialise per plan: `plan`."""
        self.plan(block_table, seq_lens, q_len)

    def plan_for_replay(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        q_len: int = 1, graph_batch_size: int | None = None) -> None:
        """Copy a batch of B <= the captured size into the static buffers; rows past B get
        length 0, so the padded rows of a larger captured graph attend nothing.
        graph_batch_size: the captured size that replays (None: the smallest >= B)."""
        batch, width = block_table.shape
        self.graph_block_table[:batch, :width].copy_(block_table)
        self.graph_seq_lens[:batch].copy_(seq_lens)
        self.graph_seq_lens[batch:].zero_()

    def set_graph_lengths(self, seq_lens: torch.Tensor) -> None:
        """While capturing, after `plan_for_capture(B, q_len)`: the lengths [B] int32 that the
        graph's next kernels read, set by device operations the graph records (backends with
        `graph_lengths_on_device`; e.g. the MTP module's recursive drafting passes)."""
        self.graph_seq_lens[:seq_lens.shape[0]].copy_(seq_lens)
