"""CUDA graphs change nothing but speed: the replay bookkeeping on CPU, graphs on the GPU."""

import os

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.engine.cuda_graphs import capture_sizes
from mlaserve.engine.graph_standins import EagerDecodeGraphs


def test_capture_sizes_cover_every_batch() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:], strict=False))


@pytest.mark.gpu
def test_graph_generation_equals_eager_in_fp32() -> None:
    """The demo model's shape through triton, dense MLPs (float32 MoE layers on CUDA loop with a
    host sync and run eagerly), dummy weights: the same greedy tokens and logprobs with and
    without graphs.

    Prompts of different lengths and max_tokens: the batch shrinks 12 -> 1, so replays pad to 16,
    8, 4, 2 and 1 rows; block size 16 puts requests across several pages.
    """
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(5 + 9 * i)] for i in range(12)]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0, logprobs=0, ignore_eos=True)
              for i in range(12)]
    results = {}
    for eager in (True, False):
        # an explicit pool: sized from free memory, the first engine would leave none for the
        # second
        llm = LLM(device="cuda", dtype="float32", attention_backend="triton", block_size=16,
                  max_num_seqs=16, num_kv_blocks=256, enforce_eager=eager, load_format="dummy",
                  hf_overrides={"first_k_dense_replace": 4})
        assert (llm.engine.runner.graphs is None) == eager
        results[eager] = llm.generate(prompts, params)
        if not eager:
            assert llm.engine.runner.graphs.num_replays > 0
    for e, g in zip(results[True], results[False], strict=True):
        assert e.token_ids == g.token_ids
        diffs = [abs(a[t] - b[t]) for a, b, t in zip(e.logprobs, g.logprobs, e.token_ids,
                                                       strict=True)]
        assert max(diffs) < 1e-4, diffs  # only the split counts (summation order) differ


@pytest.mark.gpu
def test_float32_moe_is_captured_too() -> None:
    """The Triton MoE needs no host sync in any dtype, so float32 decode steps replay graphs."""
    llm = LLM(device="cuda", dtype="float32", attention_backend="triton", block_size=16,
              max_num_seqs=4, num_kv_blocks=64)
    assert llm.engine.runner.graphs is not None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3 and llm.engine.runner.graphs.num_replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_graph_forward_equals_eager_forward(backend: str) -> None:
    """One decode forward, replayed and eager, on the same inputs (bf16, MLA dims 512 + 64).

    Rewriting a step's latents into the same slots is idempotent, so both see the same cache.
    """
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    llm = LLM(device="cuda", dtype="bfloat16", attention_backend=backend, block_size=16,
              max_num_seqs=16, load_format="dummy", num_kv_blocks=512,
              hf_overrides={"kv_lora_rank": 512, "qk_rope_head_dim": 64})
    runner = llm.engine.runner
    graphs = runner.graphs
    assert graphs is not None
    generator = torch.Generator(device="cuda").manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator, device="cuda"))
    for n in (1, 3, 12, 16):
        seq_lens = torch.randint(1, 300, (n,), generator=generator, device="cuda").int()
        width = 300 // 16 + 1
        pages = torch.randperm(512, generator=generator, device="cuda")[: n * width]
        table = pages.view(n, width).int()  # [n, width]: distinct pages per request
        positions = (seq_lens - 1).long()
        slots = table.long().gather(1, (positions // 16)[:, None]).squeeze(1) * 16 + positions % 16
        ids = torch.randint(0, 450, (n,), generator=generator, device="cuda")  # < demo vocab
        replayed = graphs.run(ids, positions, table, seq_lens).float().clone()
        assert torch.equal(graphs.slots[:n], slots)  # computed in the graph
        runner.backend.plan(table, seq_lens)
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=n,
                                 decode_backend=runner.backend)
        with torch.inference_mode():
            eager = runner.model(ids, positions, runner.kv_caches, meta).float()
        rel = float((replayed - eager).norm() / eager.norm())
        assert rel < 1e-2, (n, rel)  # bf16: same kernels, other split counts and GEMM row counts


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_buffers_padding_and_scratch_slot_on_cpu(backend: str) -> None:
    """The replay bookkeeping (static inputs, padded rows, scratch slot) without a GPU."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton backend runs on CPU only under TRITON_INTERPRET=1")
    llm = LLM(device="cpu", attention_backend=backend, block_size=4, num_kv_blocks=64)
    runner = llm.engine.runner
    graphs = EagerDecodeGraphs(runner.model, runner.kv_caches, runner.backend, max_batch_size=6,
                              max_blocks_per_seq=8, scratch_slot=64 * 4)
    assert sorted(graphs.graphs) == [(1, 1), (1, 2), (1, 4), (1, 6)]
    generator = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    for n in (1, 3, 5):
        seq_lens = torch.randint(1, 30, (n,), generator=generator).int()
        table = torch.randperm(64, generator=generator)[: n * 8].view(n, 8).int()  # [n, 8]
        positions = (seq_lens - 1).long()
        slots = table.long().gather(1, (positions // 4)[:, None]).squeeze(1) * 4 + positions % 4
        ids = torch.randint(0, 450, (n,), generator=generator)
        before = [cache.clone() for cache in runner.kv_caches]
        with torch.inference_mode():
            replayed = graphs.run(ids, positions, table, seq_lens).clone()
        padded = graphs.padded_size(n)
        assert torch.equal(graphs.slots[:n], slots)  # computed in the graph
        assert (graphs.slots[n:padded] == 64 * 4).all()  # padded rows: the scratch slot
        for old, cache in zip(before, runner.kv_caches, strict=True):
            changed = (old != cache).any(-1).flatten().nonzero().flatten()  # slots written
            assert set(changed.tolist()) <= set(slots.tolist()) | {64 * 4}
        runner.backend.plan(table, seq_lens)
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=n,
                                 decode_backend=runner.backend)
        with torch.inference_mode():
            eager = runner.model(ids, positions, runner.kv_caches, meta)
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)


def test_q_len_graphs_replay_request_major_rows_on_cpu() -> None:
    """Graphs of 3 rows per request (a speculating engine's verification): n requests' rows
    replayed through a padded size equal the eager forward planned with q_len 3; padded rows
    write only the scratch slot."""
    llm = LLM(device="cpu", attention_backend="torch", block_size=4, num_kv_blocks=64)
    runner = llm.engine.runner
    graphs = EagerDecodeGraphs(runner.model, runner.kv_caches, runner.backend, max_batch_size=4,
                              max_blocks_per_seq=8, scratch_slot=64 * 4, q_lens=(1, 3))
    assert sorted(graphs.graphs) == [(1, 1), (1, 2), (1, 4), (3, 1), (3, 2), (3, 4)]
    generator = torch.Generator().manual_seed(1)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    n, q_len = 3, 3
    seq_lens = torch.tensor([5, 17, 30], dtype=torch.int32)
    table = torch.randperm(64, generator=generator)[: n * 8].view(n, 8).int()
    positions = (seq_lens.long()[:, None] - q_len + torch.arange(q_len)).flatten()  # [n * 3]
    rows = table.long().repeat_interleave(q_len, dim=0)
    slots = rows.gather(1, (positions // 4)[:, None]).squeeze(1) * 4 + positions % 4
    ids = torch.randint(0, 450, (n * q_len,), generator=generator)
    before = [cache.clone() for cache in runner.kv_caches]
    with torch.inference_mode():
        replayed = graphs.run(ids, positions, table, seq_lens, q_len=q_len).clone()
    assert torch.equal(graphs.slots[:n * q_len], slots)  # computed in the graph
    assert (graphs.slots[n * q_len:4 * q_len] == 64 * 4).all()  # the padded request's rows
    assert replayed.shape[0] == n * q_len and graphs.num_replays == 1
    for old, cache in zip(before, runner.kv_caches, strict=True):
        changed = (old != cache).any(-1).flatten().nonzero().flatten()
        assert set(changed.tolist()) <= set(slots.tolist()) | {64 * 4}
    runner.backend.plan(table, seq_lens, q_len)
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=n * q_len,
                             decode_backend=runner.backend)
    with torch.inference_mode():
        eager = runner.model(ids, positions, runner.kv_caches, meta)
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)


def test_engine_with_replayed_decode_equals_eager_on_cpu() -> None:
    """The runner's use of graphs: decode-only steps replay (padded), prefill steps and
    sequences past the captured width run eagerly; the outputs equal an eager engine's."""
    prompts = [[(5 * i + 11 * j) % 1000 + 1 for j in range(3 + 4 * i)] for i in range(10)]
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0, logprobs=0, ignore_eos=True)
              for i in range(10)]
    kwargs = dict(device="cpu", attention_backend="torch", block_size=4, num_kv_blocks=128,
                  max_num_seqs=6, max_num_batched_tokens=24)
    eager = LLM(**kwargs).generate(prompts, params)
    llm = LLM(**kwargs)
    runner = llm.engine.runner
    runner.graphs = EagerDecodeGraphs(runner.model, runner.kv_caches, runner.backend,
                                     max_batch_size=6, max_blocks_per_seq=8,
                                     scratch_slot=128 * 4)
    replayed = llm.generate(prompts, params)
    assert runner.graphs.num_replays > 0
    for e, g in zip(eager, replayed, strict=True):
        assert e.token_ids == g.token_ids
        for a, b, t in zip(e.logprobs, g.logprobs, e.token_ids, strict=True):
            assert abs(a[t] - b[t]) < 1e-5


def test_graphs_run_only_if_every_tensor_parallel_rank_captured_them() -> None:
    """A rank's graphs replay its collectives: if one rank could not capture (it reports 0 to
    the ranks' minimum), every rank runs eagerly."""
    from mlaserve.engine.step_graphs import graphs_on_every_rank

    captured = object()  # this rank's graphs
    reported = []

    def every_rank_captured(value: int) -> int:  # the other ranks reported 1
        reported.append(value)
        return min(value, 1)

    assert graphs_on_every_rank(captured, every_rank_captured) is captured
    assert graphs_on_every_rank(None, every_rank_captured) is None
    assert reported == [1, 0]  # what this rank told the others
    assert graphs_on_every_rank(captured, lambda value: 0) is None  # another rank failed


@pytest.mark.parametrize("k", [None, 3])
def test_a_lone_prompt_prefills_in_a_graph_as_eagerly_on_cpu(k, record_drafts) -> None:
    """A step that prefills one prompt from position 0 and decodes nothing replays the prefill
    graph of its padded length (the CPU stand-ins; lengths 16, 32, 64): prompts of 5 and 40
    tokens one at a time do, while a longer one, and one whose first 64 tokens the prefix cache
    holds, prefill eagerly (and a one-token prompt is a decode row). The demo model's tokens, prompt
    logprobs and logprobs equal an eager engine's; with speculation (k = 3) the MTP module's
    passes after each replayed prefill replay a graph too, and every step's drafts equal the
    eager engine's."""
    from mlaserve.engine import graph_standins

    lengths = [1, 5, 40, 65]
    prompts = [[(3 * i + 7 * j) % 900 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    prompts.append(prompts[-1][:64] + [5, 6])  # its first 4 blocks cached: eager
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=1, prompt_logprobs=1)
    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k}
    outcomes = []
    for graphs in (False, True):
        drafted = record_drafts()
        llm = LLM(device="cpu", attention_backend="torch", block_size=16, num_kv_blocks=128,
                  speculative_config=spec)
        try:
            runner = llm.engine.runner
            if graphs:
                graph_standins.install(runner, max_batch_size=4, max_blocks_per_seq=8)
            outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
            stats = llm.engine.core.spec_stats
            outcomes.append((outputs, stats.accepted_per_pos, stats.num_drafts, drafted))
            if graphs:
                assert runner.prefill_graphs.num_replays == 2
                if k:
                    assert runner.draft_graphs.after_prefill.num_replays == 2
        finally:
            llm.shutdown()
    (eager, *eager_stats), (replayed, *replayed_stats) = outcomes
    assert eager_stats == replayed_stats
    # float32 attention over a padded chunk sums in another order: up to ~1e-5 apart (exact
    # where no row is padded); a dropped or extra key moves a logprob by far more
    for e, g in zip(eager, replayed, strict=True):
        assert e.outputs[0].token_ids == g.outputs[0].token_ids
        for a, b in zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 5e-5 for t in a)
        for a, b in zip(e.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 5e-5 for t in a)


@pytest.mark.gpu
def test_gpu_a_lone_prompt_prefills_in_a_captured_graph_in_fp32() -> None:
    """On a GPU: prompts of 5, 17 and 40 tokens one at a time replay captured prefill graphs
    (16, 32, 64 rows), and their tokens and logprobs equal an eager engine's (float32, dense
    layers as above)."""
    prompts = [[(3 * i + 7 * j) % 900 + 1 for j in range(n)] for i, n in enumerate((5, 17, 40))]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(device="cuda", dtype="float32", attention_backend="triton", block_size=16,
                  max_num_seqs=16, num_kv_blocks=256, enforce_eager=eager, load_format="dummy",
                  hf_overrides={"first_k_dense_replace": 4})
        try:
            results[eager] = [llm.generate([p], params)[0].outputs[0] for p in prompts]
            if not eager:
                assert llm.engine.runner.prefill_graphs.num_replays == 3
        finally:
            llm.shutdown()
    for e, g in zip(results[True], results[False], strict=True):
        assert e.token_ids == g.token_ids
        assert all(abs(a[t] - b[t]) < 1e-4 for a, b, t in zip(e.logprobs, g.logprobs,
                                                               e.token_ids, strict=True))
