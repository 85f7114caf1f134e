"""The `flashinfer` backend: FlashInfer's paged MLA decode kernels (optional dependency).

Kernel paths, chosen by the GPU:
- SM90 (Hopper): `flashinfer.mla.BatchMLAPagedAttentionWrapper` with backend "fa3". FlashInfer
  plans on the host from CSR page lists; `plan()` builds them on the device from the block table
  (qo_indptr = arange * q_len, kv_indptr = cumsum of pages per request, kv_indices = the used
  block-table entries, gathered by a scatter with no host sync), then copies the indptrs and
  lengths to the host in one transfer, which FlashInfer's planner needs. That transfer is the
  step's only host sync. `run()` only launches.
- SM100+ (Blackwell): `flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla` (trtllm-gen).
  Written to FlashInfer 0.5.3's API and untested on hardware; see `_TrtllmGenPath`.
- `FlashInferFA2MLABackend` ("flashinfer-fa2") forces the wrapper's portable "fa2" kernels; it
  is a peer for the kernel benchmark and is not in the registry.

Layout: FlashInfer takes c_kv and k_pe as separate tensors. The cache [num_blocks, block_size,
L + R] is passed as the strided views [..., :L] and [..., L:], and q [B * q_len, H, L + R] as
q[..., :L] and q[..., L:]: FlashInfer's MLA kernels take a page stride and a row stride for each
(the innermost dimension must be contiguous), so nothing is copied.

LSE: FlashInfer returns log2(sum exp) of the scaled scores; it is converted to the natural log
(times ln 2) here. Requests of length 0 give o = 0 and lse = -inf: the fa2/fa3 kernels write that
themselves (an empty KV range leaves m = -inf), and eager steps also overwrite those rows
explicitly (the host knows them from the plan, so it costs nothing when there are none).

CUDA graphs (wrapper path): FlashInfer's graph mode needs one wrapper per captured shape whose
index buffers never move. `init_graph_buffers()` allocates static indptr / indices / length
buffers for the largest batch; each captured (batch size, q_len) gets a wrapper over views of them
(and its own 8 MiB plan buffer, whose offsets its graph bakes in: a speculating engine's q_len
1 and k + 1 graphs of one batch size never share one); the 128 MiB float workspace is shared.
`plan_for_replay()` copies the new block table and lengths into the static buffers and re-plans
the wrapper of the smallest captured batch size >= the batch at that q_len (rows past the batch
get length 0): the graph replayed next must be that one.
"""

import importlib.util
import math
from typing import Any, ClassVar

import torch

from mlaserve.attention.base import BackendCapabilities, MLABackend, MLAShape

_LN2 = math.log(2.0)
_EMPTY_LSE_BELOW = -3.0e4  # natural log; no row with a key gets near this
# FlashInfer's recommended workspace; also what the trtllm-gen kernel is given for its semaphores.
WORKSPACE_BYTES = 128 * 1024 * 1024
_INSTALL_HINT = "flashinfer is not installed: pip install flashinfer-python"

# (purpose, device) -> workspace shared by every backend instance and layer on that device.
_workspaces: dict[tuple[str, torch.device], torch.Tensor] = {}


def shared_workspace(device: torch.device, purpose: str) -> torch.Tensor:
    """A zeroed 128 MiB uint8 workspace per (purpose, device), allocated on first use.

    Purposes: "wrapper" (the float workspace of `BatchMLAPagedAttentionWrapper`, partial outputs
    of split KV) and "trtllm-gen" (the trtllm-gen kernel's semaphores and scratch, which must be
    zero before its first use). They are kept apart so one can never corrupt the other.
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (purpose, device)
    if key not in _workspaces:
        _workspaces[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[key]


def build_page_csr(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR page lists of a batch, built on the device with no host sync.

    Args:
        block_table: [B, max_blocks] int32 page ids per request.
        seq_lens: [B] int32 KV lengths.
        block_size: tokens per page.

    Returns:
        kv_indptr: [B + 1] int32, request b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]].
        kv_indices: [B * max_blocks + 1] int32; entries past kv_indptr[B] are unused (FlashInfer
            accepts a longer array; the last entry is where unused table entries are scattered).
    """
    batch, width = block_table.shape
    device = block_table.device
    pages = (seq_lens.to(torch.int32) + (block_size - 1)) // block_size  # [B]
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    torch.cumsum(pages, dim=0, dtype=torch.int32, out=kv_indptr[1:])
    column = torch.arange(width, dtype=torch.int32, device=device)
    dest = kv_indptr[:-1, None] + column[None, :]  # [B, max_blocks] slot of each table entry
    dest = torch.where(column[None, :] < pages[:, None], dest, batch * width)
    kv_indices = torch.zeros(batch * width + 1, dtype=torch.int32, device=device)
    kv_indices.scatter_(0, dest.reshape(-1).long(), block_table.reshape(-1).to(torch.int32))
    return kv_indptr, kv_indices


class FlashInferMLABackend(MLABackend):
    """FlashInfer MLA decode: fa3 on SM90, trtllm-gen on SM100+ (see the module docstring)."""

    name = "flashinfer"
    capabilities = BackendCapabilities(
        device_types=("cuda",),
        dtypes=(torch.bfloat16, torch.float16),  # SM100 (trtllm-gen): bfloat16 only
        block_sizes=None,  # any on SM90; 32 or 64 on SM100 (checked in extra_reasons)
        min_compute_capability=None,  # 9.0, checked in extra_reasons (also without CUDA)
        supports_cuda_graphs=True,
    )
    auto_priority = 20
    # Lowest compute capability served, and the wrapper backend to force (None: by GPU).
    required_capability: ClassVar[tuple[int, int]] = (9, 0)
    wrapper_backend: ClassVar[str | None] = None

    @classmethod
    def kernel_path(cls, device: torch.device) -> str | None:
        """"fa3", "fa2" or "trtllm-gen" for a CUDA device; None where FlashInfer has no path."""
        if cls.wrapper_backend is not None:
            return cls.wrapper_backend
        major, _ = torch.cuda.get_device_capability(device)
        return {9: "fa3", 10: "trtllm-gen"}.get(major)

    @classmethod
    def extra_reasons(cls, shape: MLAShape) -> list[str]:
        reasons = []
        if importlib.util.find_spec("flashinfer") is None:
            reasons.append(_INSTALL_HINT)
        if (shape.kv_lora_rank, shape.qk_rope_head_dim) != (512, 64):
            reasons.append("FlashInfer's MLA kernels are built for kv_lora_rank 512 and "
                           f"qk_rope_head_dim 64, not {shape.kv_lora_rank} and "
                           f"{shape.qk_rope_head_dim}")
        if shape.device.type != "cuda":
            return reasons
        if not torch.cuda.is_available():
            return reasons + ["CUDA is not available"]
        capability = torch.cuda.get_device_capability(shape.device)
        want = cls.required_capability
        if capability < want:
            return reasons + [f"needs compute capability {want[0]}.{want[1]} or newer, GPU has "
                              f"{capability[0]}.{capability[1]}"]
        path = cls.kernel_path(shape.device)
        if path is None:
            reasons.append(f"no FlashInfer MLA decode kernel for compute capability "
                           f"{capability[0]}.{capability[1]} (fa3 is SM90, trtllm-gen SM100)")
        elif path == "trtllm-gen":
            reasons += _TrtllmGenPath.reasons(shape)
        return reasons

    def __init__(self, shape: MLAShape, softmax_scale: float) -> None:
        super().__init__(shape, softmax_scale)
        path = self.kernel_path(shape.device)
        try:
            impl = (_TrtllmGenPath if path == "trtllm-gen" else _WrapperPath)(self, path)
        except ImportError as exc:
            raise ValueError(f"attention backend '{self.name}': {_INSTALL_HINT} ({exc})") from exc
        self.kernel = impl

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int = 1) -> None:
        self.kernel.plan(block_table, seq_lens, q_len)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, return_lse: bool = False
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.kernel.run(q, kv_cache, return_lse)

    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        self.kernel.init_graph_buffers(max_batch_size, max_blocks_per_seq)

    def plan_for_capture(self, batch_size: int, q_len: int = 1) -> None:
        self.kernel.plan_for_capture(batch_size, q_len)

    def plan_for_replay(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        q_len: int = 1, graph_batch_size: int | None = None) -> None:
        self.kernel.plan_for_replay(block_table, seq_lens, q_len, graph_batch_size)

    def _base_init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        super().init_graph_buffers(max_batch_size, max_blocks_per_seq)

    def _copy_graph_inputs(self, block_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Copy a batch into the static buffers (rows past it get length 0)."""
        super().plan_for_replay(block_table, seq_lens)


class FlashInferFA2MLABackend(FlashInferMLABackend):
    """FlashInfer's portable fa2 MLA kernels (SM80+): a benchmark peer, not registered."""

    name = "flashinfer-fa2"
    auto_priority = 0
    required_capability = (8, 0)
    wrapper_backend = "fa2"


def _empty_rows(seq_lens_host: torch.Tensor, q_len: int, device: torch.device
                ) -> torch.Tensor | None:
    """Output rows [n] int64 of the requests with no KV, or None when there are none."""
    empty = torch.nonzero(seq_lens_host == 0).flatten()
    if empty.numel() == 0:
        return None
    rows = empty[:, None] * q_len + torch.arange(q_len)  # [n_empty, q_len]
    return rows.flatten().to(device)


def _clear_empty_rows(rows: torch.Tensor | None, o: torch.Tensor, lse: torch.Tensor | None
                      ) -> None:
    if rows is None:
        return
    o.index_fill_(0, rows, 0.0)
    if lse is not None:
        lse.index_fill_(0, rows, float("-inf"))


class _WrapperPath:
    """`BatchMLAPagedAttentionWrapper` (fa3 / fa2): eager wrapper plus one per graph shape."""

    def __init__(self, owner: FlashInferMLABackend, wrapper_backend: str) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self.owner = owner
        self.wrapper_cls = BatchMLAPagedAttentionWrapper
        self.wrapper_backend = wrapper_backend
        self.workspace = shared_workspace(owner.shape.device, "wrapper")
        self.eager_wrapper = BatchMLAPagedAttentionWrapper(self.workspace, backend=wrapper_backend)
        self.graph_wrappers: dict[tuple[int, int], Any] = {}  # by (batch size, q_len)
        self.wrapper: Any = None  # the wrapper planned for the current step
        self.empty_rows: torch.Tensor | None = None

    def _plan_wrapper(self, wrapper: Any, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      q_len: int, eager: bool) -> None:
        shape = self.owner.shape
        batch = block_table.shape[0]
        kv_indptr, kv_indices = build_page_csr(block_table, seq_lens, shape.block_size)
        # FlashInfer's planner reads indptrs and lengths on the host: one transfer for both.
        host = torch.cat([kv_indptr, seq_lens.to(torch.int32)]).cpu()
        kv_indptr_host, seq_lens_host = host[: batch + 1], host[batch + 1 :]
        qo_indptr_host = torch.arange(batch + 1, dtype=torch.int32) * q_len
        wrapper.plan(
            qo_indptr_host, kv_indptr_host, kv_indices, seq_lens_host,
            shape.num_heads, shape.kv_lora_rank, shape.qk_rope_head_dim, shape.block_size,
            q_len > 1,  # causal among the new tokens
            self.owner.softmax_scale, shape.dtype, shape.dtype)
        self.wrapper = wrapper
        # A graph replays the same launches whatever the lengths: no host-side fix-up there.
        self.empty_rows = _empty_rows(seq_lens_host, q_len, shape.device) if eager else None

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int) -> None:
        self._plan_wrapper(self.eager_wrapper, block_table, seq_lens, q_len, eager=True)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, return_lse: bool
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        rank = self.owner.shape.kv_lora_rank
        q_nope, q_pe = q[..., :rank], q[..., rank:]  # [B * q_len, H, L], [B * q_len, H, R]
        ckv, kpe = kv_cache[..., :rank], kv_cache[..., rank:]  # [blocks, block_size, L | R]
        o = torch.empty(q.shape[0], q.shape[1], rank, dtype=q.dtype, device=q.device)
        if not return_lse:
            self.wrapper.run(q_nope, q_pe, ckv, kpe, out=o)
            _clear_empty_rows(self.empty_rows, o, None)
            return o
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        self.wrapper.run(q_nope, q_pe, ckv, kpe, out=o, lse=lse, return_lse=True)
        lse.mul_(_LN2)  # base 2 -> natural log
        # Rows that see no key carry FlashInfer's finite sentinel (-5e4 in base 2): make it -inf.
        lse.masked_fill_(lse < _EMPTY_LSE_BELOW, float("-inf"))
        _clear_empty_rows(self.empty_rows, o, lse)
        return o, lse

    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        self.owner._base_init_graph_buffers(max_batch_size, max_blocks_per_seq)
        device = self.owner.shape.device
        self.graph_qo_indptr = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=device)
        self.graph_kv_indptr = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=device)
        self.graph_kv_len = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        self.graph_kv_indices = torch.zeros(max_batch_size * max_blocks_per_seq + 1,
                                            dtype=torch.int32, device=device)
        self.graph_wrappers = {}

    def _graph_wrapper(self, batch_size: int, q_len: int) -> Any:
        wrapper = self.graph_wrappers.get((batch_size, q_len))
        if wrapper is None:
            wrapper = self.wrapper_cls(
                self.workspace, use_cuda_graph=True,
                qo_indptr=self.graph_qo_indptr[: batch_size + 1],
                kv_indptr=self.graph_kv_indptr[: batch_size + 1],
                kv_indices=self.graph_kv_indices,
                kv_len_arr=self.graph_kv_len[:batch_size],
                backend=self.wrapper_backend)
            self.graph_wrappers[batch_size, q_len] = wrapper
        return wrapper

    def plan_for_capture(self, batch_size: int, q_len: int) -> None:
        if not hasattr(self, "graph_kv_indices"):
            raise RuntimeError("init_graph_buffers() must be called before planning for graphs")
        owner = self.owner
        self._plan_wrapper(self._graph_wrapper(batch_size, q_len),
                           owner.graph_block_table[:batch_size],
                           owner.graph_seq_lens[:batch_size], q_len, eager=False)

    def plan_for_replay(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        q_len: int, graph_batch_size: int | None = None) -> None:
        batch = block_table.shape[0]
        captured = [size for size, planned_q_len in self.graph_wrappers
                    if planned_q_len == q_len and size >= batch
                    and graph_batch_size in (None, size)]
        if not captured:
            raise RuntimeError(f"no graph was planned for a batch of {batch} at q_len {q_len} "
                               f"(planned (batch, q_len): {sorted(self.graph_wrappers)}, asked: "
                               f"{graph_batch_size})")
        graph_batch = min(captured)
        owner = self.owner
        owner._copy_graph_inputs(block_table, seq_lens)
        self._plan_wrapper(self.graph_wrappers[graph_batch, q_len],
                           owner.graph_block_table[:graph_batch],
                           owner.graph_seq_lens[:graph_batch], q_len, eager=False)


class _TrtllmGenPath:
    """SM100+: `flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla` (trtllm-gen).

    Written to FlashInfer 0.5.3's API and untested on hardware. What it relies on:
    - query [B, q_len, H, L + R] and kv_cache [num_blocks, 1, block_size, L + R] (the cache with
      a unit head axis), block size 32 or 64, a block table whose width is a multiple of
      128 / block_size (padded here with page 0, never read past a request's length),
      seq_lens [B] int32 and a host-side max_seq_len (the table's capacity, so no host sync and
      a static value under CUDA graphs);
    - bmm1_scale = the softmax scale, bmm2_scale = 1 (no fp8 scales), bfloat16 only (the
      kernel writes a bfloat16 output);
    - a zeroed 128 MiB workspace shared by all layers on the device (`shared_workspace`);
    - qk_nope_head_dim is only checked by FlashInfer (it must be 128); it is passed as 128.
    The kernel returns no LSE, so `return_lse=True` raises NotImplementedError. Rows of
    requests with length 0 are zeroed on the device with a mask (one extra pass over o),
    since it is unknown what the kernel writes for them.
    """

    def __init__(self, owner: FlashInferMLABackend, path: str) -> None:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

        self.owner = owner
        self.decode = trtllm_batch_decode_with_kv_cache_mla
        self.workspace = shared_workspace(owner.shape.device, "trtllm-gen")
        self.width_multiple = 128 // owner.shape.block_size

    @staticmethod
    def reasons(shape: MLAShape) -> list[str]:
        reasons = []
        if shape.block_size not in (32, 64):
            reasons.append(f"trtllm-gen MLA needs block_size 32 or 64, not {shape.block_size}")
        if shape.dtype != torch.bfloat16:
            reasons.append(f"trtllm-gen MLA runs bfloat16 only, not {shape.dtype}")
        return reasons

    def _padded_width(self, width: int) -> int:
        return -(-width // self.width_multiple) * self.width_multiple

    def _set_step(self, block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int) -> None:
        batch, width = block_table.shape
        padded = self._padded_width(width)
        if padded != width:
            block_table = torch.nn.functional.pad(block_table, (0, padded - width))
        self.block_table = block_table  # [B, padded width] int32
        self.seq_lens = seq_lens.to(torch.int32)
        self.max_seq_len = padded * self.owner.shape.block_size
        self.q_len = q_len

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int) -> None:
        self._set_step(block_table, seq_lens, q_len)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, return_lse: bool) -> torch.Tensor:
        if return_lse:
            raise NotImplementedError("FlashInfer's trtllm-gen MLA decode returns no LSE")
        shape = self.owner.shape
        batch = self.block_table.shape[0]
        query = q.reshape(batch, self.q_len, shape.num_heads, shape.head_dim)  # [B, q_len, H, D]
        out = self.decode(
            query=query, kv_cache=kv_cache.unsqueeze(1), workspace_buffer=self.workspace,
            qk_nope_head_dim=128, kv_lora_rank=shape.kv_lora_rank,
            qk_rope_head_dim=shape.qk_rope_head_dim, block_tables=self.block_table,
            seq_lens=self.seq_lens, max_seq_len=self.max_seq_len,
            bmm1_scale=self.owner.softmax_scale, bmm2_scale=1.0)
        o = out.reshape(batch, self.q_len * shape.num_heads * shape.kv_lora_rank)
        o.masked_fill_((self.seq_lens == 0)[:, None], 0.0)
        return o.view(batch * self.q_len, shape.num_heads, shape.kv_lora_rank)  # [B*q_len, H, L]

    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        self.owner._base_init_graph_buffers(max_batch_size, self._padded_width(max_blocks_per_seq))

    def plan_for_capture(self, batch_size: int, q_len: int) -> None:
        owner = self.owner
        self._set_step(owner.graph_block_table[:batch_size], owner.graph_seq_lens[:batch_size],
                       q_len)

    def plan_for_replay(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        q_len: int, graph_batch_size: int | None = None) -> None:
        self.owner._copy_graph_inputs(block_table, seq_lens)
