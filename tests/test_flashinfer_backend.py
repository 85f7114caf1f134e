"""The `flashinfer` backend (docs/architecture.md, "Contracts").

On a GPU with FlashInfer (SM90+) the backend runs against the float32 reference on adversarial
batches: shuffled block tables, NaN in unused pages and page tails, lengths 0, 1, block - 1,
block, block + 1 and long, ragged, block sizes 16 to 128, 16 and 128 heads, q_len 1, 2 and 4,
the natural-log LSE, and the CUDA-graph hooks under real capture and replay.

Without them: `supports()` gives clear reasons, the CSR page lists are checked, and the adapter
(argument order, views, LSE base, empty requests, graph bookkeeping, the SM100 path's padding)
runs on the CPU against test-local stand-ins that follow FlashInfer 0.5.3's documented contract:
a wrapper that plans from CSR page lists (kv_indptr gives each request's first page, kv_len its
length) and returns a base-2 LSE, and a trtllm-gen function that takes a padded block table.
"""

import importlib.machinery
import importlib.util
import math
import sys
import types
from dataclasses import replace

import pytest
import torch

from mlaserve.attention import flashinfer_backend as fib
from mlaserve.attention.base import MLAShape
from mlaserve.attention.flashinfer_backend import (
    FlashInferFA2MLABackend,
    FlashInferMLABackend,
    build_page_csr,
)
from mlaserve.attention.registry import mla_decode, select_backend
from mlaserve.kernels.reference import mla_decode_reference
from mlaserve.kernels.testing import assert_matches_reference, poisoned_paged_batch

ON_GPU = torch.cuda.is_available()
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
CAPABILITY = torch.cuda.get_device_capability() if ON_GPU else (0, 0)
PATH = FlashInferMLABackend.kernel_path(torch.device("cuda")) if ON_GPU else None
_sm90_flashinfer = pytest.mark.skipif(
    not (ON_GPU and HAS_FLASHINFER and CAPABILITY >= (9, 0)),
    reason="needs a CUDA GPU of compute capability >= 9.0 and flashinfer")


def gpu(test):
    """The `gpu` marker (skipped without CUDA by conftest.py), and FlashInfer on sm_90+."""
    return pytest.mark.gpu(_sm90_flashinfer(test))
SCALE = 1 / math.sqrt(192)


def make_case(lengths: list[int], block_size: int, num_heads: int, q_len: int,
              dtype: torch.dtype, device: torch.device, seed: int = 0, rank: int = 512,
              rope: int = 64):
    """`poisoned_paged_batch` plus its float32 reference, on `device`."""
    q, cache, table, seq_lens = poisoned_paged_batch(lengths, num_heads, rank, rope, block_size,
                                                     q_len, dtype, seed, padding_columns=0)
    ref_o, ref_lse = mla_decode_reference(q, cache, table, seq_lens, SCALE, rank, q_len)
    return [t.to(device) for t in (q, cache, table, seq_lens, ref_o, ref_lse)]


def assert_matches(o, lse, ref_o, ref_lse, dtype):
    """The shared comparator (`mlaserve.kernels.testing`) against the float32 reference."""
    assert_matches_reference(o, lse, ref_o, ref_lse, dtype)


def shape_for(num_heads=16, block_size=64, dtype=torch.bfloat16, device="cuda", q_len=1,
              rank=512, rope=64) -> MLAShape:
    return MLAShape(num_heads=num_heads, kv_lora_rank=rank, qk_rope_head_dim=rope,
                    block_size=block_size, dtype=dtype, device=torch.device(device),
                    max_q_len=q_len)


# ---------------------------------------------------------------------------------------------
# CPU: reasons, CSR page lists


def test_supports_gives_clear_reasons_without_cuda():
    reasons = FlashInferMLABackend.supports(shape_for(device="cpu"))
    assert "runs on cuda, not cpu" in reasons
    assert ("flashinfer is not installed: pip install flashinfer-python" in reasons) \
        == (not HAS_FLASHINFER)
    with pytest.raises(ValueError, match="attention backend 'flashinfer' cannot serve"):
        FlashInferMLABackend(shape_for(device="cpu"), SCALE)
    with pytest.raises(ValueError, match="runs on cuda, not cpu"):
        select_backend("flashinfer_mla", shape_for(device="cpu"))
    assert select_backend("auto", shape_for(device="cpu")).name == "torch"
    odd = FlashInferMLABackend.supports(shape_for(device="cpu", rank=256, dtype=torch.float32))
    assert any("kv_lora_rank 512 and qk_rope_head_dim 64, not 256 and 64" in r for r in odd)
    assert any("dtype float32 not in (bfloat16, float16)" in r for r in odd)


@pytest.mark.parametrize(("capability", "block_size", "dtype", "expected"), [
    ((8, 0), 64, torch.bfloat16, "needs compute capability 9.0 or newer, GPU has 8.0"),
    ((12, 0), 64, torch.bfloat16, "no FlashInfer MLA decode kernel for compute capability 12.0"),
    ((10, 0), 16, torch.bfloat16, "trtllm-gen MLA needs block_size 32 or 64, not 16"),
    ((10, 0), 64, torch.float16, "trtllm-gen MLA runs bfloat16 only"),
    ((9, 0), 16, torch.float16, None),  # fa3: any block size, float16 too
    ((10, 0), 32, torch.bfloat16, None),
])
def test_reasons_per_gpu_generation(monkeypatch, capability, block_size, dtype, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    reasons = FlashInferMLABackend.supports(shape_for(block_size=block_size, dtype=dtype))
    if not HAS_FLASHINFER:
        reasons.remove("flashinfer is not installed: pip install flashinfer-python")
    if expected is None:
        assert reasons == []
    else:
        assert len(reasons) == 1 and expected in reasons[0], reasons


def test_fa2_peer_is_not_registered_and_serves_sm80(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert FlashInferFA2MLABackend.name == "flashinfer-fa2"
    assert FlashInferFA2MLABackend.kernel_path(torch.device("cuda")) == "fa2"
    reasons = FlashInferFA2MLABackend.supports(shape_for())
    assert all("compute capability" not in r for r in reasons)
    assert FlashInferMLABackend.auto_priority == 20 > FlashInferFA2MLABackend.auto_priority


def test_page_csr_from_a_shuffled_ragged_table():
    table = torch.tensor([[7, 3, 9], [4, 1, 1], [2, 8, 5], [6, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([9, 0, 4, 1], dtype=torch.int32)  # block 4: 3, 0, 1, 1 pages
    kv_indptr, kv_indices = build_page_csr(table, lengths, 4)
    assert kv_indptr.tolist() == [0, 3, 3, 4, 5]
    assert kv_indptr.dtype == kv_indices.dtype == torch.int32
    assert kv_indices.shape == (4 * 3 + 1,)
    assert kv_indices[:5].tolist() == [7, 3, 9, 2, 6]
    assert fib._empty_rows(lengths, 2, torch.device("cpu")).tolist() == [2, 3]
    assert fib._empty_rows(torch.tensor([3, 1]), 1, torch.device("cpu")) is None


# ---------------------------------------------------------------------------------------------
# CPU: the adapter against stand-ins for FlashInfer 0.5.3's API


class FakeMLAWrapper:
    """BatchMLAPagedAttentionWrapper's contract in torch: plan on host CSR, base-2 LSE.

    Like the kernel, run() reads page ids from the indices buffer at run time (the static one in
    graph mode) and the plan (indptrs, lengths) from plan time. Rows of empty requests come out
    NaN, so that the adapter's own handling of them is what is tested.
    """

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):
        assert backend in ("fa2", "fa3")
        self.use_cuda_graph = use_cuda_graph
        self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type,
             use_profiler=False):
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == torch.int32
        if self.use_cuda_graph:
            qo_buf, kv_indptr_buf, indices_buf, len_buf = self.buffers
            qo_buf.copy_(qo_indptr)  # sizes must match the batch exactly, as in FlashInfer
            kv_indptr_buf.copy_(kv_indptr)
            indices_buf[: len(kv_indices)].copy_(kv_indices)
            len_buf.copy_(kv_len_arr)
            self.indices = indices_buf
        else:
            self.indices = kv_indices
        self.qo_indptr, self.kv_indptr = qo_indptr.tolist(), kv_indptr.tolist()
        self.kv_len = kv_len_arr.tolist()
        self.settings = (num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        num_heads, rank, rope, page_size, causal, scale = self.settings
        for t in (q_nope, q_pe, ckv_cache, kpe_cache):
            assert t.stride(-1) == 1
        assert q_nope.shape[1:] == (num_heads, rank) and q_pe.shape[-1] == rope
        assert ckv_cache.shape[1:] == (page_size, rank) and kpe_cache.shape[-1] == rope
        batch = len(self.kv_len)
        q_len = self.qo_indptr[1] - self.qo_indptr[0]
        assert self.qo_indptr == [b * q_len for b in range(batch + 1)]
        assert causal == (q_len > 1)
        width = max(max(-(-n // page_size) for n in self.kv_len), 1)
        table = torch.zeros(batch, width, dtype=torch.int32)
        for b, n in enumerate(self.kv_len):
            count = -(-n // page_size)
            start = self.kv_indptr[b]
            table[b, :count] = self.indices[start:start + count]
        cache = torch.cat([ckv_cache, kpe_cache], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        o, lse_e = mla_decode_reference(q, cache, table, torch.tensor(self.kv_len), scale, rank,
                                        q_len)
        empty = torch.tensor(self.kv_len).repeat_interleave(q_len) == 0
        o[empty], lse_e[empty] = float("nan"), float("nan")
        out.copy_(o)
        if not return_lse:
            return out
        lse = torch.empty(q_nope.shape[:2]) if lse is None else lse
        lse.copy_(lse_e / math.log(2))
        return out, lse


def fake_trtllm_mla(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank,
                    qk_rope_head_dim, block_tables, seq_lens, max_seq_len, out=None,
                    bmm1_scale=1.0, bmm2_scale=1.0, sinks=None, enable_pdl=None,
                    backend="auto"):
    """trtllm_batch_decode_with_kv_cache_mla's checks and result in torch."""
    assert query.ndim == 4 and kv_cache.ndim == 4 and kv_cache.shape[1] == 1
    assert (qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim) == (128, 512, 64)
    block_size = kv_cache.shape[2]
    assert block_size in (32, 64) and block_tables.shape[1] % (128 // block_size) == 0
    assert max_seq_len == block_tables.shape[1] * block_size and bmm2_scale == 1.0
    batch, q_len, num_heads, head_dim = query.shape
    o, _ = mla_decode_reference(query.reshape(batch * q_len, num_heads, head_dim),
                                kv_cache[:, 0], block_tables, seq_lens, bmm1_scale,
                                kv_lora_rank, q_len)
    o[seq_lens.repeat_interleave(q_len) == 0] = float("nan")
    return o.to(torch.bfloat16).view(batch, q_len, num_heads, kv_lora_rank)


@pytest.fixture
def cpu_flashinfer(monkeypatch):
    """The backend on the CPU with the stand-ins in place of FlashInfer; yields a factory."""
    package = types.ModuleType("flashinfer")
    package.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    package.__path__ = []
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = FakeMLAWrapper
    decode = types.ModuleType("flashinfer.decode")
    decode.trtllm_batch_decode_with_kv_cache_mla = fake_trtllm_mla
    for name, module in (("flashinfer", package), ("flashinfer.mla", mla),
                         ("flashinfer.decode", decode)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fib, "shared_workspace",
                        lambda device, purpose: torch.zeros(16, dtype=torch.uint8))

    def make(path: str, **shape_kwargs):
        class CpuBackend(FlashInferMLABackend):
            capabilities = replace(FlashInferMLABackend.capabilities, device_types=("cpu",),
                                   dtypes=(torch.float32, torch.bfloat16))

            @classmethod
            def kernel_path(cls, device):
                return path

        return CpuBackend(shape_for(device="cpu", **shape_kwargs), SCALE)

    return make


@pytest.mark.parametrize("q_len", [1, 2])
def test_wrapper_adapter_on_the_cpu(cpu_flashinfer, q_len):
    block = 4
    backend = cpu_flashinfer("fa3", num_heads=3, block_size=block, dtype=torch.float32,
                             q_len=q_len)
    lengths = [5, 0, block - 1, block, block + 1, 1, 13]
    q, cache, table, seq_lens, ref_o, ref_lse = make_case(
        [n if n == 0 else max(n, q_len) for n in lengths], block, 3, q_len, torch.float32,
        torch.device("cpu"))
    backend.plan(table, seq_lens, q_len)
    o, lse = backend.run(q, cache, return_lse=True)
    assert_matches(o, lse, ref_o, ref_lse, torch.float32)  # natural log, empty rows 0 / -inf
    assert_matches(backend.run(q, cache), None, ref_o, ref_lse, torch.float32)


def test_wrapper_graph_hooks_on_the_cpu(cpu_flashinfer):
    """A wrapper per captured (batch size, q_len): a speculating engine captures q_len 1 and
    k + 1 at each batch size, and each replay re-plans the wrapper its graph was captured with."""
    block, max_blocks = 4, 4
    backend = cpu_flashinfer("fa3", num_heads=2, block_size=block, dtype=torch.float32, q_len=2)
    backend.init_graph_buffers(8, max_blocks)
    for batch_size in (4, 8):
        for q_len in (1, 2):
            backend.plan_for_capture(batch_size, q_len)
    wrappers = backend.kernel.graph_wrappers
    assert sorted(wrappers) == [(4, 1), (4, 2), (8, 1), (8, 2)]
    assert len({id(wrapper) for wrapper in wrappers.values()}) == 4
    for seed, (lengths, graph_batch) in enumerate([([5, 9, 2], 4), ([16, 3, 7, 2, 11], 8),
                                                   ([2, 2, 2, 2], 4)]):
        q, cache, table, seq_lens, ref_o, ref_lse = make_case(lengths, block, 2, 2,
                                                              torch.float32,
                                                              torch.device("cpu"), seed=seed)
        backend.plan_for_replay(table, seq_lens, 1)
        assert backend.kernel.wrapper is wrappers[graph_batch, 1]
        backend.plan_for_replay(table, seq_lens, 2)
        assert backend.kernel.wrapper is wrappers[graph_batch, 2]
        assert backend.graph_seq_lens[len(lengths):].eq(0).all()
        padded = torch.zeros(graph_batch * 2, 2, 576)
        padded[: len(lengths) * 2] = q
        o, lse = backend.run(padded, cache, return_lse=True)
        rows = len(lengths) * 2  # padded rows rely on the kernel (checked on the GPU)
        assert_matches(o[:rows], lse[:rows], ref_o, ref_lse, torch.float32)
    with pytest.raises(RuntimeError, match="no graph was planned for a batch of 9"):
        backend.plan_for_replay(torch.zeros(9, 1, dtype=torch.int32),
                                torch.ones(9, dtype=torch.int32), 2)
    with pytest.raises(RuntimeError, match="batch of 3 at q_len 3"):
        backend.plan_for_replay(torch.zeros(3, 1, dtype=torch.int32),
                                torch.ones(3, dtype=torch.int32), 3)


@pytest.mark.parametrize("block", [32, 64])
def test_trtllm_gen_adapter_on_the_cpu(cpu_flashinfer, block):
    backend = cpu_flashinfer("trtllm-gen", num_heads=2, block_size=block, q_len=2)
    lengths = [0, 2, block - 1, block + 1, 3 * block]  # 3 pages: padded to a multiple of 4 or 2
    q, cache, table, seq_lens, ref_o, ref_lse = make_case(lengths, block, 2, 2, torch.bfloat16,
                                                          torch.device("cpu"))
    backend.plan(table, seq_lens, 2)
    assert backend.kernel.block_table.shape[1] % (128 // block) == 0
    assert_matches(backend.run(q, cache), None, ref_o, ref_lse, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="no LSE"):
        backend.run(q, cache, return_lse=True)
    backend.init_graph_buffers(8, 3)
    backend.plan_for_capture(8, 2)
    assert backend.graph_block_table.shape == (8, -(-3 // (128 // block)) * (128 // block))
    backend.plan_for_replay(table, seq_lens, 2)
    padded = torch.zeros(16, 2, 576, dtype=torch.bfloat16)
    padded[:10] = q
    o = backend.run(padded, cache)
    assert_matches(o[:10], None, ref_o, ref_lse, torch.bfloat16)
    assert bool((o[10:] == 0).all())


# ---------------------------------------------------------------------------------------------
# GPU: the real kernels


def _gpu_lengths(block: int, q_len: int) -> list[int]:
    gen = torch.Generator().manual_seed(block * 10 + q_len)
    ragged = torch.randint(q_len, 3 * block + 40, (5,), generator=gen).tolist()
    edge = [1, block - 1, block, block + 1, 2000]
    return [0] + [max(n, q_len) for n in edge] + ragged


@gpu
@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_against_reference(block, num_heads, q_len):
    shape = shape_for(num_heads=num_heads, block_size=block, q_len=q_len)
    reasons = FlashInferMLABackend.supports(shape)
    if reasons:
        pytest.skip("; ".join(reasons))
    q, cache, table, seq_lens, ref_o, ref_lse = make_case(
        _gpu_lengths(block, q_len), block, num_heads, q_len, torch.bfloat16,
        torch.device("cuda"), seed=block + num_heads + q_len)
    backend = FlashInferMLABackend(shape, SCALE)
    backend.plan(table, seq_lens, q_len)
    if PATH == "trtllm-gen":
        assert_matches(backend.run(q, cache), None, ref_o, ref_lse, torch.bfloat16)
        return
    o, lse = backend.run(q, cache, return_lse=True)
    assert_matches(o, lse, ref_o, ref_lse, torch.bfloat16)
    assert_matches(backend.run(q, cache), None, ref_o, ref_lse, torch.bfloat16)


@gpu
@pytest.mark.skipif(PATH == "trtllm-gen", reason="trtllm-gen runs bfloat16 only")
@pytest.mark.parametrize("q_len", [1, 2])
def test_float16(q_len):
    q, cache, table, seq_lens, ref_o, ref_lse = make_case(
        _gpu_lengths(64, q_len), 64, 16, q_len, torch.float16, torch.device("cuda"), seed=7)
    o, lse = mla_decode(q, cache, table, seq_lens, SCALE, q_len=q_len, backend="flashinfer",
                        return_lse=True)
    assert_matches(o, lse, ref_o, ref_lse, torch.float16)


@gpu
def test_only_empty_requests():
    q, cache, table, seq_lens, ref_o, ref_lse = make_case([0, 0, 0], 64, 16, 1, torch.bfloat16,
                                                          torch.device("cuda"))
    backend = FlashInferMLABackend(shape_for(), SCALE)
    backend.plan(table, seq_lens)
    o = backend.run(q, cache)
    assert bool((o == 0).all())


@gpu
def test_auto_prefers_flashinfer_and_aliases_resolve():
    shape = shape_for()
    assert select_backend("auto", shape) is FlashInferMLABackend
    assert select_backend("FLASHINFER_MLA", shape) is FlashInferMLABackend
    with pytest.raises(ValueError, match="kv_lora_rank 512"):
        select_backend("flashinfer", shape_for(rank=256))


@gpu
@pytest.mark.skipif(CAPABILITY[0] != 9, reason="the fa2 peer is checked where fa3 runs")
@pytest.mark.parametrize("q_len", [1, 2])
def test_fa2_peer(q_len):
    shape = shape_for(q_len=q_len)
    q, cache, table, seq_lens, ref_o, ref_lse = make_case(
        _gpu_lengths(64, q_len), 64, 16, q_len, torch.bfloat16, torch.device("cuda"), seed=3)
    backend = FlashInferFA2MLABackend(shape, SCALE)
    backend.plan(table, seq_lens, q_len)
    o, lse = backend.run(q, cache, return_lse=True)
    assert_matches(o, lse, ref_o, ref_lse, torch.bfloat16)


def capture(backend, batch_size: int, q_len: int, q_static: torch.Tensor, pool: torch.Tensor,
            want_lse: bool) -> tuple:
    """Plan the graph of (batch_size, q_len), warm it up on a side stream and capture it:
    (graph, its output) over the first batch_size * q_len rows of q_static."""
    backend.plan_for_capture(batch_size, q_len)
    rows = q_static[: batch_size * q_len]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.run(rows, pool, return_lse=want_lse)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = backend.run(rows, pool, return_lse=want_lse)
    return graph, result


def replay(backend, graph, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
           seq_lens: torch.Tensor, q_len: int, q_static: torch.Tensor,
           pool: torch.Tensor) -> None:
    """Copy a case's queries and cache into the captured buffers, re-plan for its table and
    lengths, replay the graph and wait for it."""
    pool[: cache.shape[0]].copy_(cache)
    q_static.zero_()
    q_static[: q.shape[0]].copy_(q)
    backend.plan_for_replay(table, seq_lens, q_len)
    graph.replay()
    torch.cuda.synchronize()


@gpu
@pytest.mark.parametrize(("num_heads", "q_len"), [(16, 1), (128, 1), (16, 2)])
def test_cuda_graph_capture_and_replay(num_heads, q_len):
    """Capture batch sizes 4 and 8 once; replay smaller, ragged batches with new tables."""
    block, max_blocks, pool_blocks = 64, 12, 160
    shape = shape_for(num_heads=num_heads, block_size=block, q_len=q_len)
    backend = FlashInferMLABackend(shape, SCALE)
    backend.init_graph_buffers(8, max_blocks)
    q_static = torch.zeros(8 * q_len, num_heads, 576, dtype=torch.bfloat16, device="cuda")
    pool = torch.full((pool_blocks, block, 576), float("nan"), dtype=torch.bfloat16,
                      device="cuda")
    want_lse = PATH != "trtllm-gen"
    graphs = {}
    for batch_size in (4, 8):
        graphs[batch_size] = capture(backend, batch_size, q_len, q_static, pool, want_lse)
    replays = [([700, 1, 64], 4), ([65, 300, 0, 129, 63], 8), ([5, 9, 760, 2, 2, 2, 2, 2], 8),
               ([2], 4)]
    for seed, (lengths, graph_batch) in enumerate(replays):
        lengths = [n if n == 0 else max(n, q_len) for n in lengths]
        q, cache, table, seq_lens, ref_o, ref_lse = make_case(
            lengths, block, num_heads, q_len, torch.bfloat16, torch.device("cuda"), seed=seed)
        assert cache.shape[0] <= pool_blocks and table.shape[1] <= max_blocks
        pool.fill_(float("nan"))
        graph, result = graphs[graph_batch]
        replay(backend, graph, q, cache, table, seq_lens, q_len, q_static, pool)
        o, lse = result if want_lse else (result, None)
        real = len(lengths) * q_len
        assert_matches(o[:real], None if lse is None else lse[:real], ref_o, ref_lse,
                       torch.bfloat16)
        assert bool((o[real:] == 0).all()), "padded rows (length 0) must give 0"
        if lse is not None:
            assert bool(torch.isneginf(lse[real:]).all()), "padded rows must give lse -inf"


@gpu
def test_graphs_of_two_query_lengths_at_one_batch_size():
    """A speculating engine's ladders: q_len 1 and 4 captured at batch 4, replayed in turn,
    each against the float32 reference after the other's plan."""
    block, max_blocks, pool_blocks, num_heads, batch = 64, 12, 160, 16, 4
    backend = FlashInferMLABackend(shape_for(num_heads=num_heads, block_size=block, q_len=4),
                                   SCALE)
    backend.init_graph_buffers(batch, max_blocks)
    q_static = torch.zeros(batch * 4, num_heads, 576, dtype=torch.bfloat16, device="cuda")
    pool = torch.zeros(pool_blocks, block, 576, dtype=torch.bfloat16, device="cuda")
    graphs = {}
    for q_len in (1, 4):
        graphs[q_len] = capture(backend, batch, q_len, q_static, pool, False)
    for seed, q_len in enumerate((4, 1, 4, 1)):
        lengths = [700, 5, 129, 64][: 3 + seed % 2]
        q, cache, table, seq_lens, ref_o, ref_lse = make_case(
            lengths, block, num_heads, q_len, torch.bfloat16, torch.device("cuda"), seed=seed)
        graph, result = graphs[q_len]
        replay(backend, graph, q, cache, table, seq_lens, q_len, q_static, pool)
        real = len(lengths) * q_len
        assert_matches(result[:real], None, ref_o, ref_lse, torch.bfloat16)
