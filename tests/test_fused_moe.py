"""The Triton MoE kernels (`fused_moe`) against the float64 per-token reference.

Without a CUDA GPU they run in Triton's CPU interpreter, in float32 and float16 (the
interpreter's bfloat16 dot is not faithful), with tiles small enough that every case has several
M-, N- and K-blocks, a ragged N edge (I = 48 against 32 gate columns, D = 48 against 32 down
columns) and a ragged K edge (48-deep rows against 32-deep tiles). With a GPU the same tests
run natively, in bfloat16 too, plus DeepSeek-V2-Lite's shape and a CUDA-graph replay.
"""

import dataclasses
import json
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from mlaserve.kernels import fused_moe_config  # noqa: E402
from mlaserve.kernels.fused_moe import fused_experts_triton  # noqa: E402
from mlaserve.kernels.fused_moe_config import (  # noqa: E402
    FusedMoEConfig,
    GemmTiles,
    moe_config,
)
from mlaserve.kernels.moe import (  # noqa: E402
    REFERENCE_TOLERANCES,
    fused_experts,
    fused_experts_loop,
    moe_graph_capturable,
    reference_errors,
)
from mlaserve.kernels.moe_align import align_by_expert  # noqa: E402
from tests.test_moe import dense_reference  # noqa: E402

pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or TRITON_INTERPRET=1")
gpu_only = pytest.mark.gpu  # skipped without CUDA (conftest.py)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
SMALL_TILES = FusedMoEConfig(
    block_m=16,
    gate_up=GemmTiles(block_n=32, block_k=16, group_size_m=2, num_warps=4, num_stages=2),
    down=GemmTiles(block_n=32, block_k=32, group_size_m=1, num_warps=4, num_stages=2),
)
# the same tiles computed transposed (W x^T) in both kernels
SWAPPED_TILES = FusedMoEConfig(
    block_m=16, gate_up=dataclasses.replace(SMALL_TILES.gate_up, swap_ab=True),
    down=dataclasses.replace(SMALL_TILES.down, swap_ab=True))


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_routing(kind: str, num_tokens: int, num_experts: int, top_k: int,
                 generator: torch.Generator) -> torch.Tensor:
    """topk_ids [T, K] int64 of one kind of routing.

    distinct: each token's experts differ, and the last expert gets no token.
    one_expert: every pair on expert 1 (a token repeats it K times).
    repeats: drawn with replacement, so a token may pick an expert twice.
    """
    if kind == "distinct":
        ids = [torch.randperm(num_experts - 1, generator=generator)[:top_k]
               for _ in range(num_tokens)]
        return torch.stack(ids)
    if kind == "one_expert":
        return torch.ones(num_tokens, top_k, dtype=torch.int64)
    return torch.randint(num_experts, (num_tokens, top_k), generator=generator)


def make_inputs(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                routing: str, dtype: torch.dtype, seed: int = 0):
    """(x [T, D], gate_up_proj [E, 2I, D], down_proj [E, D, I], topk_weights [T, K] float32,
    topk_ids [T, K] int64) on DEVICE, scaled so activations and outputs are O(1)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=generator) / inter ** 0.5
    weights = torch.rand(num_tokens, top_k, generator=generator) + 0.1
    ids = make_routing(routing, num_tokens, num_experts, top_k, generator)
    return (x.to(DEVICE, dtype), gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype),
            weights.to(DEVICE), ids.to(DEVICE))


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rel_bound, cos_bound = REFERENCE_TOLERANCES[dtype]
    assert out.shape == ref.shape and out.dtype == dtype
    rel_err, cos_gap = reference_errors(out, ref)
    assert rel_err < rel_bound and cos_gap < cos_bound, (rel_err, cos_gap)


def expected_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_ids, expert_ids, num_padded) built in Python: each expert's pair ids in order,
    padded with the sentinel T * K to a multiple of block_m."""
    flat = topk_ids.flatten().tolist()  # [T * K]
    sentinel = len(flat)
    rows: list[int] = []
    experts: list[int] = []
    for expert in range(num_experts):
        run = [pair for pair, e in enumerate(flat) if e == expert]
        run += [sentinel] * (-len(run) % block_m)
        rows += run
        experts += [expert] * (len(run) // block_m)
    max_padded = sentinel + min(num_experts, sentinel) * (block_m - 1)
    num_blocks = -(-max_padded // block_m)
    return (rows + [sentinel] * (max_padded - len(rows)),
            experts + [-1] * (num_blocks - len(experts)), len(rows))


def test_alignment_of_a_hand_made_routing():
    # pairs t * 2 + k: expert 0 gets pairs 1, 4; expert 1 none; expert 2 pairs 0, 2, 5; expert 3
    # pair 3. Runs of 4 rows, the sentinel 6 pads them; the bound is 6 + 4 * 3 = 18 rows.
    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    alignment = align_by_expert(topk_ids, num_experts=4, block_m=4)
    assert alignment.sorted_ids.tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6] + [6] * 6
    assert alignment.expert_ids.tolist() == [0, 2, 3, -1, -1]
    assert alignment.num_padded.tolist() == [12]
    assert alignment.sorted_ids.dtype == alignment.expert_ids.dtype == torch.int32


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", [
    (1, 64, 6, 16),  # fewer pairs than experts: the bound counts T * K runs, not E
    (40, 12, 3, 4),  # 120 pairs fit one chunk: the one-program kernel; 54 M-blocks
    (1500, 8, 2, 64),  # 3000 pairs: three chunks of 1024
    (600, 256, 8, 16),  # 75 chunks of 64, more than one tile of chunks and of M-blocks
])
def test_alignment_matches_python(num_tokens, num_experts, top_k, block_m):
    generator = torch.Generator().manual_seed(num_tokens)
    topk_ids = make_routing("repeats", num_tokens, num_experts, top_k, generator)
    topk_ids[: num_tokens // 2, 0] = 5  # one crowded expert
    alignment = align_by_expert(topk_ids.to(DEVICE), num_experts, block_m)
    sorted_ids, expert_ids, num_padded = expected_alignment(topk_ids, num_experts, block_m)
    assert alignment.sorted_ids.tolist() == sorted_ids
    assert alignment.expert_ids.tolist() == expert_ids
    assert alignment.num_padded.tolist() == [num_padded]


def test_alignment_gives_unrouted_pairs_no_row():
    """Pairs with id -1 are left out of every expert's run (and the sentinel stays T * K), in
    the one-program kernel and in the three-kernel path."""
    for num_tokens, num_experts, top_k, block_m in ((40, 12, 3, 4), (600, 256, 8, 16)):
        generator = torch.Generator().manual_seed(num_tokens)
        topk_ids = make_routing("repeats", num_tokens, num_experts, top_k, generator)
        topk_ids[torch.rand(topk_ids.shape, generator=generator) < 0.5] = -1
        alignment = align_by_expert(topk_ids.to(DEVICE), num_experts, block_m)
        sorted_ids, expert_ids, num_padded = expected_alignment(topk_ids, num_experts, block_m)
        assert alignment.sorted_ids.tolist() == sorted_ids
        assert alignment.expert_ids.tolist() == expert_ids
        assert alignment.num_padded.tolist() == [num_padded]


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_triton_unrouted_pairs_add_nothing(dtype):
    """-1 ids (expert parallelism's other ranks' experts, padding rows) add nothing: the reference
    without those pairs, a whole row of -1 gives zeros (its output rows are zeroed, not left
    as the buffer held them)."""
    x, gate_up, down, weights, ids = make_inputs(17, 64, 48, 8, 3, "distinct", dtype)
    unrouted = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.4
    unrouted[4] = True
    unrouted = unrouted.to(DEVICE)
    ids = ids.masked_fill(unrouted, -1)
    ref = dense_reference(x, gate_up, down, weights.masked_fill(unrouted, 0), ids.clamp(min=0))
    out = fused_experts_triton(x, gate_up, down, weights, ids, config=SMALL_TILES,
                               has_unrouted=True)
    assert out[4].abs().max() == 0
    assert_matches(out, ref, dtype)


SHAPES = [  # (T, D, I, E, K)
    (1, 32, 48, 4, 1),
    (3, 64, 32, 8, 2),
    (17, 48, 48, 8, 3),
]


@pytest.mark.parametrize("config", [SMALL_TILES, SWAPPED_TILES], ids=["xWt", "Wxt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("routing", ["distinct", "one_expert", "repeats"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_matches_reference(shape, routing, dtype, config):
    num_tokens, hidden, inter, num_experts, top_k = shape
    inputs = make_inputs(num_tokens, hidden, inter, num_experts, top_k, routing, dtype)
    out = fused_experts_triton(*inputs, config=config)
    assert_matches(out, dense_reference(*inputs), dtype)


def test_default_config_and_dispatch():
    inputs = make_inputs(17, 64, 48, 8, 3, "distinct", torch.float32)
    ref = dense_reference(*inputs)
    for impl in ("auto", "triton", "grouped", "loop"):
        assert_matches(fused_experts(*inputs, impl=impl), ref, torch.float32)
    with pytest.raises(ValueError, match="unknown MoE implementation"):
        fused_experts(*inputs, impl="dense")


def test_a_dropped_pair_is_caught():
    """The comparator fails an output that misses one of 51 (token, expert) pairs by far, even at
    the loosest (bf16) bounds: the per-row cosine sees the one row, the norm the whole output."""
    x, gate_up, down, weights, ids = make_inputs(17, 64, 48, 8, 3, "distinct", torch.float32)
    out = fused_experts_triton(x, gate_up, down, weights, ids, config=SMALL_TILES)
    dropped = weights.clone()
    dropped[5, 1] = 0  # token 5 loses its second expert
    rel_err, cos_gap = reference_errors(out, dense_reference(x, gate_up, down, dropped, ids))
    rel_bound, cos_bound = REFERENCE_TOLERANCES[torch.bfloat16]
    assert rel_err > 5 * rel_bound and cos_gap > 100 * cos_bound


def test_float32_loop_is_the_reference():
    """`fused_experts_loop` in float32 (the benchmark's reference) from float16 inputs agrees with
    the per-token float64 reference to float32 accuracy."""
    inputs = make_inputs(17, 64, 48, 8, 3, "repeats", torch.float16)
    ref = fused_experts_loop(*inputs, compute_dtype=torch.float32)
    assert ref.dtype == torch.float32
    rel_err, cos_gap = reference_errors(ref, dense_reference(*inputs))
    assert rel_err < 1e-6 and cos_gap < 1e-10


def test_config_table_and_heuristic(monkeypatch, tmp_path):
    """The heuristic's block_m by rows per expert; then a tuned file of this GPU model (written
    as `bench moe --sweep --configs-dir` writes it) wins for its weight format only."""
    v2_lite = dict(num_experts=64, hidden=2048, inter=1408, dtype=torch.bfloat16)
    block_ms = [moe_config(tokens * 6, **v2_lite).block_m for tokens in (1, 64, 256, 1024, 8192)]
    assert block_ms == [16, 16, 32, 64, 128]
    assert moe_config(6, **{**v2_lite, "dtype": torch.float32}).gate_up.block_k == 64
    decode, prefill = SMALL_TILES, moe_config(8192 * 6, **v2_lite)
    monkeypatch.setattr(fused_moe_config, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(fused_moe_config, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    fused_moe_config.tuned_configs.cache_clear()
    path = fused_moe_config.tuned_config_path(64, 2048, 1408, "16-bit", "NVIDIA H100 80GB HBM3")
    assert path == tmp_path / "E=64,D=2048,I=1408,weights=16-bit,NVIDIA_H100_80GB_HBM3.json"
    path.write_text(json.dumps({"configs": {"6": dataclasses.asdict(decode),
                                            "1536": dataclasses.asdict(prefill)}}))
    gpu = dict(v2_lite, device=torch.device("cuda", 0))
    try:
        assert moe_config(48, **gpu) == decode  # 8x from 6, 32x from 1536
        assert moe_config(1000, **gpu) == prefill
        assert moe_config(48, **{**gpu, "dtype": torch.float16}) == decode  # 16-bit shares it
        assert moe_config(48, **v2_lite) == fused_moe_config.default_config(48, 64, torch.bfloat16)
        float32 = moe_config(48, **{**gpu, "dtype": torch.float32})  # never tuned
        assert float32 == fused_moe_config.default_config(48, 64, torch.float32)
        fp8 = dict(gpu, dtype=torch.float8_e4m3fn)  # another format: its own file, none here
        assert moe_config(48, **fp8) == fused_moe_config.default_config(48, 64, torch.float8_e4m3fn)
    finally:
        fused_moe_config.tuned_configs.cache_clear()


def test_shipped_tuned_configs_load_and_keep_fp8_block_k():
    """Every tuned file in the package parses, and its FP8 entries keep block_k in a scale
    block (the kernels refuse others)."""
    for path in fused_moe_config.CONFIG_DIR.glob("*.json"):
        body = json.loads(path.read_text())
        configs = [fused_moe_config.config_from_json(entry) for entry in body["configs"].values()]
        assert configs, path
        if "weights=fp8" in path.name:
            assert all(128 % c.gate_up.block_k == 0 and 128 % c.down.block_k == 0
                       for c in configs), path


def test_graph_capturable():
    assert moe_graph_capturable(torch.device("cpu"), torch.float16)
    for dtype in DTYPES:  # Triton is installed: every CUDA dtype runs without a host sync
        assert moe_graph_capturable(torch.device("cuda"), dtype)


# DeepSeek-V2-Lite's routed experts: D = 2048, I = 1408, E = 64, K = 6.
V2_LITE = dict(hidden=2048, inter=1408, num_experts=64, top_k=6)


@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 1024])
def test_v2_lite_bf16_matches_the_float32_reference(num_tokens):
    # Bounds: REFERENCE_TOLERANCES[bf16], derived where it is defined (three bf16 roundings,
    # ~3e-3 relative error, so 1 - cos ~ 5e-6 against a bound of 5e-5). The reference is the
    # float32 loop, itself checked against the float64 per-token reference above.
    torch.backends.cuda.matmul.allow_tf32 = False
    inputs = make_inputs(num_tokens, **V2_LITE, routing="distinct", dtype=torch.bfloat16)
    ref = fused_experts_loop(*inputs, compute_dtype=torch.float32)
    assert_matches(fused_experts(*inputs, impl="triton"), ref, torch.bfloat16)


@gpu_only
def test_v2_lite_cuda_graph_replay():
    inputs = make_inputs(16, **V2_LITE, routing="repeats", dtype=torch.bfloat16)
    eager = fused_experts(*inputs, impl="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_experts(*inputs, impl="triton")
    x, gate_up, down, weights, ids = inputs
    ids.copy_(torch.flip(ids, dims=[0]))  # new routing, same buffers
    weights.copy_(torch.flip(weights, dims=[0]))
    x.copy_(torch.flip(x, dims=[0]))
    graph.replay()
    torch.testing.assert_close(captured, torch.flip(eager, dims=[0]))
