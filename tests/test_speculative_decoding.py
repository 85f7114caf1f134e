"""Speculative decoding with the MTP module (engine/speculative.py, spec_decode.py), on the demo
config with an MTP layer and dummy weights (CPU, float32).

Dummy MTP weights draft tokens the model never samples, which checks rejection; an oracle
drafter (the runner's `draft` replaced by one that proposes the tokens of a run without
speculation, some of them corrupted) checks acceptance: accepted drafts' cache entries are what
later positions attend to, so a wrong slot, position or count changes the text. Greedy outputs
must equal decoding without speculation through chunked prefill, preemption and the prefix
cache; sampled outputs (temperature 0.8, top-p) must follow the same distribution.
"""

from collections import Counter

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.config import ModelConfig
from mlaserve.engine import graph_standins
from mlaserve.engine import runner as runner_module
from mlaserve.engine.args import DEMO_MODEL_DIR, EngineArgs
from mlaserve.engine.engine_config import check_speculative
from mlaserve.engine.graph_standins import EagerDecodeGraphs
from mlaserve.engine.request import StructuredOutputs
from mlaserve.engine.speculative import SpecDecodeStats, SpeculativeConfig, speculates
from mlaserve.model.deepseek import DeepseekForCausalLM

OVERRIDES = {"num_nextn_predict_layers": 1, "num_hidden_layers": 2}
LONG = "Tell me a story about a cat and a dog. " * 3  # 3 blocks of 16 tokens and more
PROMPTS = ["What is 12 + 30?", "Tell me a story about a cat and a dog", "abc", LONG]


def make_llm(k: int | None, **kwargs) -> LLM:
    options = dict(load_format="dummy", hf_overrides=OVERRIDES, device="cpu", block_size=16,
                   num_kv_blocks=128)
    options.update(kwargs)
    if k is not None:
        options["speculative_config"] = {"method": "deepseek_mtp", "num_speculative_tokens": k}
    return LLM(**options)


def run(llm: LLM, prompts: list, params: SamplingParams | list) -> list[list[int]]:
    outputs = llm.generate(prompts, params)
    return [list(o.outputs[0].token_ids) for o in outputs]


GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def generate_without_speculation(prompts: list, params: SamplingParams | list) -> list:
    """The request outputs of an engine that does not speculate (the comparisons' baseline)."""
    plain = make_llm(None)
    try:
        return plain.generate(prompts, params)
    finally:
        plain.shutdown()


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs without speculation, by prompt token ids (the prompt's ids + outputs)."""
    llm = make_llm(None)
    try:
        out = {}
        for output in llm.generate(PROMPTS, GREEDY):
            prompt = tuple(output.prompt_token_ids)
            out[prompt] = list(prompt) + list(output.outputs[0].token_ids)
        return out
    finally:
        llm.shutdown()


def oracle(reference: dict, vocab_size: int, wrong_every: int, monkeypatch) -> list:
    """Replace the runner's drafter with one that proposes the reference's next tokens, every
    `wrong_every`-th proposal (by position) off by one; returns the drafts proposed."""
    proposed = []

    def draft(model, mtp_cache, meta, backend, inputs, block_size, k, rows, hidden, positions,
              samplers, graphs=None, replayed=None, prefill_length=None, expert_capacity=0):
        drafts = []
        for request, last in zip(samplers, rows.last_positions.tolist(), strict=True):
            full = reference[tuple(request.prompt_token_ids)]
            # known after this step: tokens up to index last + 1; drafts for last + 2 ..
            ids = [full[i] if i < len(full) else 0 for i in range(last + 2, last + 2 + k)]
            ids = [(t + 1) % vocab_size if (last + 2 + j) % wrong_every == 0 else t
                   for j, t in enumerate(ids)]
            proposed.append(ids)
            drafts.append(ids)
        return torch.tensor(drafts, dtype=torch.int64, device=hidden.device).view(-1, k)

    monkeypatch.setattr(runner_module, "draft", draft)
    return proposed


def test_the_config_takes_vllms_spelling_and_refuses_what_it_cannot_serve():
    assert SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 3}) == \
        SpeculativeConfig("mtp", 3)
    for bad, says in [({"method": "eagle"}, "not served"),
                      ({"num_speculative_tokens": 0}, "from 1 to 4"),
                      ({"num_speculative_tokens": 5}, "from 1 to 4"),
                      ({"num_speculative_tokens": True}, "from 1 to 4"),
                      ({"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
                      ([1], "JSON object")]:
        with pytest.raises(ValueError, match=says):
            SpeculativeConfig.from_dict(bad)
    args = EngineArgs(speculative_config={"num_speculative_tokens": 2})
    assert args.speculative_config == SpeculativeConfig("deepseek_mtp", 2)
    with pytest.raises(ValueError, match="no MTP module"):  # (the demo model has one)
        LLM(load_format="dummy", device="cpu", speculative_config={"method": "mtp"},
            hf_overrides={"num_nextn_predict_layers": 0})
    demo = ModelConfig.from_pretrained(DEMO_MODEL_DIR)
    for parallel in [dict(data_parallel_size=2), dict(tensor_parallel_size=2),
                     dict(data_parallel_size=2, tensor_parallel_size=2),
                     dict(data_parallel_size=2, enable_expert_parallel=True)]:
        check_speculative(EngineArgs(speculative_config={"method": "mtp"}, **parallel), demo)


def test_auto_prefers_a_backend_whose_graphs_draft_when_speculating():
    """On CUDA `auto` puts FlashInfer first, except for a speculating engine (decode rows of
    q_len k + 1): FlashInfer plans on the host, so the MTP module's passes could not replay in
    one graph, and the backend whose graphs read their lengths on the device goes first."""
    from mlaserve.attention.base import MLAShape
    from mlaserve.attention.registry import _auto_candidates, backend_class

    def shape(max_q_len: int) -> MLAShape:
        return MLAShape(16, 512, 64, 64, torch.bfloat16, torch.device("cuda"), max_q_len)

    assert _auto_candidates(shape(1))[0] == "flashinfer"
    first = _auto_candidates(shape(4))[0]
    assert first == "triton" and backend_class(first).capabilities.graph_lengths_on_device


def test_prompt_chunks_that_do_not_sample_still_fill_the_mtp_cache():
    """The MTP module's first pass runs in every step, drafting or not: a long prompt prefilled
    alone in chunks of 8 tokens (steps where nothing samples) leaves the MTP layer's KV at
    every prompt position, so its drafts attend to the whole prompt (before, only the last
    chunk's and later positions were written)."""
    llm = make_llm(3, max_num_batched_tokens=8)
    try:
        cache = llm.engine.runner.mtp_cache
        cache.fill_(float("nan"))
        output = llm.generate([LONG], SamplingParams(max_tokens=1, temperature=0))[0]
        written = int(torch.isfinite(cache).all(dim=-1).sum())
        assert len(output.prompt_token_ids) > 3 * 8
        # every prompt position, and the two recursive drafting passes' positions after it
        assert written == len(output.prompt_token_ids) + 2
    finally:
        llm.shutdown()


def test_which_requests_speculate():
    assert speculates(SamplingParams(temperature=0.8, top_p=0.9, top_k=5, min_p=0.1))
    for params in [SamplingParams(logprobs=2), SamplingParams(presence_penalty=0.5),
                   SamplingParams(repetition_penalty=1.2), SamplingParams(min_tokens=3),
                   SamplingParams(logit_bias={5: 1.0}),
                   SamplingParams(structured_outputs=StructuredOutputs(regex="[ab]+"))]:
        assert speculates(params)
    for params in [SamplingParams(structured_outputs=StructuredOutputs(regex="[ab]+",
                                                                       after_token_id=5)),
                   SamplingParams(min_tokens=2,
                                  structured_outputs=StructuredOutputs(regex="[ab]+"))]:
        assert not speculates(params)


def test_stats_count_acceptance_per_position():
    stats = SpecDecodeStats()
    stats.observe(3, 2, 3)
    stats.observe(3, 0, 3)
    stats.observe(1, 1, 3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 7, 3)
    assert stats.accepted_per_pos == [2, 1, 0]
    assert stats.mean_acceptance_length == pytest.approx(2.0)
    later = SpecDecodeStats([5, 3, 1], 5, 13, 9)
    interval = later.since(stats)  # what the stats line and the eval report
    assert (interval.num_drafts, interval.num_accepted_tokens) == (2, 6)
    assert interval.accepted_per_pos == [3, 2, 1] and interval.mean_acceptance_length == 4.0
    assert interval.acceptance_per_pos == [1.5, 1.0, 0.5]
    assert SpecDecodeStats([2, 1], 4, 8, 3).since(SpecDecodeStats()).accepted_per_pos == [2, 1]
    from mlaserve.eval.harness import spec_delta

    delta = spec_delta({"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                        "accepted_per_pos": []},
                       {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 18,
                        "accepted_per_pos": [9, 6, 3]})
    assert delta["mean_acceptance_length"] == pytest.approx(2.8)
    assert delta["acceptance_per_pos"] == pytest.approx([0.9, 0.6, 0.3])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_no_speculation_with_the_mtp_drafts(k, reference):
    llm = make_llm(k)
    try:
        assert run(llm, PROMPTS, GREEDY) == [reference[tuple(llm.tokenizer.encode(p))][
            len(llm.tokenizer.encode(p)):] for p in PROMPTS]
        stats = llm.engine.core.stats()
        assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    finally:
        llm.shutdown()


@pytest.mark.parametrize("k,wrong_every,options", [
    (1, 4, {}),
    (3, 5, {}),
    (2, 3, {"max_num_batched_tokens": 8}),  # prompts in chunks of 8 tokens
    (3, 7, {"num_kv_blocks": 6}),  # 96 slots for 3 requests of up to ~30 tokens: preemption
])
def test_accepted_drafts_leave_the_output_as_it_was(k, wrong_every, options, reference,
                                                    monkeypatch):
    llm = make_llm(k, **options)
    try:
        proposed = oracle(reference, llm.engine.core.config.model.vocab_size, wrong_every,
                          monkeypatch)
        got = run(llm, PROMPTS, GREEDY)
        prompts = [tuple(llm.tokenizer.encode(p)) for p in PROMPTS]
        assert got == [reference[p][len(p):] for p in prompts]
        stats = llm.engine.core.stats()
        assert proposed and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        # fewer steps than tokens: each accepted draft saved one
        assert stats.spec_num_accepted_tokens >= len(got) * 4
        if "num_kv_blocks" in options:
            assert stats.num_preemptions > 0
        pool = llm.engine.core.pool
        assert pool.num_free_blocks == pool.num_blocks  # every block given back, none leaked
    finally:
        llm.shutdown()


def test_verification_replays_decode_graphs_of_q_len_k_plus_1(reference, monkeypatch):
    """With decode graphs (the CPU stand-in of tests/test_cuda_graphs.py) a speculating engine
    replays the q_len k + 1 graphs for its verification steps, the MTP module drafting from
    the replayed hidden states, and decodes as without speculation."""

    k = 2
    llm = make_llm(k)
    try:
        runner = llm.engine.runner
        runner.graphs = EagerDecodeGraphs(runner.model, runner.kv_caches, runner.backend,
                                         max_batch_size=4, max_blocks_per_seq=8,
                                         scratch_slot=runner.num_blocks * runner.block_size,
                                         q_lens=(1, k + 1))
        replayed = Counter()
        run_graph = runner.graphs.run

        def counting_run(*args, **kwargs):
            replayed[kwargs.get("q_len", args[5] if len(args) > 5 else 1)] += 1
            return run_graph(*args, **kwargs)

        monkeypatch.setattr(runner.graphs, "run", counting_run)
        oracle(reference, llm.engine.core.config.model.vocab_size, 3, monkeypatch)
        prompts = [tuple(llm.tokenizer.encode(p)) for p in PROMPTS[:3]]
        assert run(llm, PROMPTS[:3], GREEDY) == [reference[p][len(p):] for p in prompts]
        assert replayed[k + 1] > 0
        assert llm.engine.core.stats().spec_num_accepted_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("kind", "sampling"), [
    ("greedy", {}), (None, {"logprobs": 1}), ("sampled", {"temperature": 0.8, "seed": 7}),
    ("filtered", {"temperature": 0.8, "top_p": 0.9, "seed": 7})])
def test_drafting_graphs_propose_the_eager_drafts(kind, sampling, record_drafts):
    """The demo model's trained MTP layer (drafts mostly accepted), k = 3: with the decode and
    drafting graphs (the CPU stand-ins) every draft, every output and every logprob equals the
    eager engine's. Requests that want no logprobs verify and draft in one graph after each
    verification's decode graph, greedy or sampled (the same seeds, the same tokens); with
    logprobs the step verifies eagerly and the drafting graph (all k passes, reading the
    decode graph's static inputs and output) replays after both kinds of decode graph: plain
    decodes (q_len 1) and verifications (4). A step that prefills runs eagerly, and its drafts
    after the first come from the recursive passes' graph."""
    prompts = ["What is 12 + 30?", "What is 48 + 35 - 17?", "Compute 7 * 8."]
    params = [SamplingParams(**{"max_tokens": 24, "temperature": 0, **sampling})
              for _ in prompts]
    for i, p in enumerate(params):  # each request its own seed and temperature (its row's)
        if p.temperature:
            p.seed, p.temperature = p.seed + i, p.temperature - 0.1 * i
    logprobs = params[0].logprobs
    outcomes = []
    for graphs in (False, True):
        drafted = record_drafts()  # every step's drafts, by request id
        llm = LLM(device="cpu", attention_backend="torch", num_kv_blocks=256,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        try:
            runner = llm.engine.runner
            if graphs:
                graph_standins.install(runner, max_batch_size=4, max_blocks_per_seq=8)
                replays = Counter()
                run_draft = runner.draft_graphs.run

                def counting_run(*args, _count=replays, _run=run_draft):
                    _count[args[3]] += 1  # by q_len
                    return _run(*args)

                runner.draft_graphs.run = counting_run
            outputs = llm.generate(prompts, params)
            stats = llm.engine.core.spec_stats
            outcomes.append(([o.token_ids for o in outputs], [o.logprobs for o in outputs],
                             stats.accepted_per_pos, stats.num_drafts, drafted))
            if graphs:
                assert runner.graphs.num_replays > 0 and replays[1] > 0
                # the prompts' steps ran eagerly: their passes 2..k replayed the recursive graph
                assert runner.draft_graphs.recursive.num_replays > 0
                verifying = {k: g.num_replays for k, g in runner.verify_graphs.items()}
                if kind is not None:  # every verification in the one graph of its kind
                    assert verifying[kind] > 0 and replays[4] == 0
                    assert sum(verifying.values()) == verifying[kind]
                else:
                    assert not any(verifying.values()) and replays[4] > 0
        finally:
            llm.shutdown()
    (tokens, entry_lists, *stats), (graph_tokens, graph_entry_lists, *graph_stats) = outcomes
    assert tokens == graph_tokens and stats == graph_stats
    for entries, graph_entries in zip(entry_lists, graph_entry_lists, strict=True):
        assert (entries is None) == (logprobs is None) == (graph_entries is None)
        for entry, graph_entry in zip(entries or [], graph_entries or [], strict=True):  # padded:
            assert entry.keys() == graph_entry.keys()  # other sums, the same to 1e-5
            assert all(abs(entry[t] - graph_entry[t]) < 1e-5 for t in entry)
    assert stats[0][2] > 0  # third drafts accepted: the recursive passes drafted well


def test_a_prompt_cached_by_an_earlier_request_decodes_the_same(reference, monkeypatch):
    llm = make_llm(2)
    try:
        oracle(reference, llm.engine.core.config.model.vocab_size, 3, monkeypatch)
        ids = tuple(llm.tokenizer.encode(LONG))
        first = run(llm, [LONG], GREEDY)
        again = run(llm, [LONG], GREEDY)
        assert first == again == [reference[ids][len(ids):]]
        assert llm.engine.core.stats().prefix_hits > 0
    finally:
        llm.shutdown()


def test_penalties_bias_and_min_tokens_count_the_drafts_before_each_position(monkeypatch):
    """Requests with penalties, a logit bias and min_tokens speculate: the verification counts
    the drafts before each position as generated, so with drafts that are mostly right (an
    oracle of the penalised outputs) the greedy outputs equal those without speculation."""
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                             frequency_penalty=1.5, logit_bias={7: 2.0}),
              SamplingParams(max_tokens=16, temperature=0, min_tokens=8,
                             frequency_penalty=0.8)]
    want = generate_without_speculation(PROMPTS[:3], params)
    penalised = {tuple(o.prompt_token_ids): list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                 for o in want}
    llm = make_llm(3)
    try:
        oracle(penalised, llm.engine.core.config.model.vocab_size, 4, monkeypatch)
        got = llm.generate(PROMPTS[:3], params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert llm.engine.core.stats().spec_num_accepted_tokens >= 3 * 8
    finally:
        llm.shutdown()


@pytest.mark.parametrize("k", [1, 3])
def test_a_grammar_constrained_request_speculates_and_stays_valid(k, monkeypatch):
    """A regex-constrained request speculates beside unconstrained ones: its mask at each
    verified position is the grammar's state after the drafts before it, so drafts that are
    mostly right (an oracle of the output without speculation, every third one off by one,
    which the grammar may refuse) are accepted where the grammar and the model agree, and the
    output matches the regex and equals the output without speculation."""
    import re

    from mlaserve.engine.structured import StructuredOutputManager

    constrained = SamplingParams(max_tokens=12, temperature=0,
                                 structured_outputs=StructuredOutputs(regex="((ab|ba)+c)+"))
    walk = StructuredOutputManager._draft_bitmask
    walks = []
    monkeypatch.setattr(StructuredOutputManager, "_draft_bitmask",
                        lambda self, *args: walks.append(1) or walk(self, *args))
    for prompts, params in (([PROMPTS[0]], [constrained]),  # alone: its own acceptance
                            (PROMPTS[:3], [constrained, GREEDY, GREEDY])):
        want = generate_without_speculation(prompts, params)
        outputs = {tuple(o.prompt_token_ids): list(o.prompt_token_ids)
                   + list(o.outputs[0].token_ids) for o in want}
        llm = make_llm(k)
        walks.clear()
        try:
            oracle(outputs, llm.engine.core.config.model.vocab_size, 3, monkeypatch)
            got = llm.generate(prompts, params)
            text = got[0].outputs[0].text
            assert re.fullmatch(r"((ab|ba)+c)*(ab|ba)*[abc]?", text), text
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids
                                                             for o in want]
            stats = llm.engine.core.stats()
            assert walks and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        finally:
            llm.shutdown()


@pytest.mark.parametrize("budget", [None, 16])
def test_logprobs_of_every_emitted_token_equal_those_without_speculation(reference,
                                                                          monkeypatch, budget):
    """A request asking for logprobs speculates: every token of a verified run (accepted
    drafts and the bonus) gets its entry, the token's and the top 2 logprobs as a step without
    speculation reports them. With a budget of 16 tokens a step the long prompt's last chunk
    samples its first token beside requests that verify."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    prompts = PROMPTS if budget else PROMPTS[:3]
    want = generate_without_speculation(prompts, params)
    llm = make_llm(3, **({"max_num_batched_tokens": budget} if budget else {}))
    try:
        oracle(reference, llm.engine.core.config.model.vocab_size, 5, monkeypatch)
        got = llm.generate(prompts, params)
        assert llm.engine.core.stats().spec_num_accepted_tokens > 0
        for g, w in zip(got, want, strict=True):
            g, w = g.outputs[0], w.outputs[0]
            assert g.token_ids == w.token_ids and len(g.logprobs) == len(g.token_ids)
            for entry, expected, token in zip(g.logprobs, w.logprobs, g.token_ids, strict=True):
                assert set(entry) == set(expected) and token in entry
                for t in entry:
                    assert abs(entry[t] - expected[t]) < 1e-4, (t, entry, expected)
    finally:
        llm.shutdown()


def test_rejected_positions_give_their_whole_blocks_back():
    from mlaserve.cache.block_pool import BlockPool
    from mlaserve.config import SchedulerConfig
    from mlaserve.engine.request import Request, RequestStatus
    from mlaserve.engine.scheduler import Scheduler

    pool = BlockPool(32, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=64), pool, num_speculative_tokens=3)
    request = Request("r", None, list(range(7)), SamplingParams(max_tokens=20), 0,
                      speculates=True)
    scheduler.add(request)
    batch = scheduler.schedule()  # the prompt: 7 tokens + 2 lookahead = 3 blocks
    assert len(request.block_ids) == 3
    scheduler.advance(batch)
    request.output_token_ids.append(5)
    scheduler.land(request)
    request.draft_token_ids = [1, 2, 3]
    batch = scheduler.schedule()  # position 7 and 3 drafts, then 2 lookahead: 13 -> 4 blocks
    assert batch.decodes == [request] and request.num_scheduled_drafts == 3
    assert len(request.block_ids) == 4 and request.status == RequestStatus.RUNNING
    scheduler.advance(batch)
    assert request.num_computed_tokens == 11
    request.output_token_ids.append(9)  # every draft rejected: one token emitted
    scheduler.land(request, num_drafts=3, num_rejected=3)
    assert request.num_computed_tokens == 8  # positions 0..7
    assert len(request.block_ids) == 3  # 9 tokens + 2 lookahead fit 3 blocks
    assert pool.num_free_blocks == 32 - 3


def test_blocks_given_back_after_a_rejection_leave_the_runners_tables_too():
    """A rejection gives a block back, and the next step takes another in its place: the
    runners must drop the old block id (another request may own it now) and take the new
    one, so their tables equal the scheduler's."""
    from mlaserve.cache.block_pool import BlockPool
    from mlaserve.config import SchedulerConfig
    from mlaserve.engine.request import Request
    from mlaserve.engine.scheduler import Scheduler
    from mlaserve.engine.step_plan import PlanBuilder

    pool = BlockPool(32, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=64), pool, num_speculative_tokens=3)
    plans = PlanBuilder()
    request = Request("r", None, list(range(7)), SamplingParams(max_tokens=20), 0,
                      speculates=True)
    scheduler.add(request)
    runner_blocks: list[int] = []  # as RunnerRequest.update keeps them

    def step(num_rejected: int) -> None:
        batch = scheduler.schedule()
        plan = plans.plan(batch.decodes, batch.prefills, batch.sampling_requests)
        (scheduled,) = [*plan.decodes, *plan.prefills]
        if scheduled.num_kept_blocks >= 0:
            del runner_blocks[scheduled.num_kept_blocks:]
        runner_blocks.extend(scheduled.new_block_ids)
        assert runner_blocks == request.block_ids
        scheduler.advance(batch)
        emitted = 1 + request.num_scheduled_drafts - num_rejected
        request.output_token_ids.extend([5] * emitted)
        scheduler.land(request, batch.verified_drafts["r"] if batch.decodes else 0, num_rejected)
        request.draft_token_ids = [1, 2, 3]

    step(0)  # the prompt: 3 blocks
    step(3)  # 4 blocks for its step, 3 kept after every draft is rejected
    assert len(request.block_ids) == 3
    step(0)  # a fourth block again, another id than the one given back
    step(2)
    step(0)


@pytest.mark.parametrize("k", [2, 3])
def test_requests_decode_up_to_max_model_len_as_without_speculation(k):
    """Requests that run into max_model_len (64 tokens, blocks of 16): the blocks a speculating
    request owns past its tokens for the MTP module's later drafts (k - 1 positions) reach past
    max_model_len, and the runner's block table holds them (a table of max_model_len's 4 blocks
    failed the request); every output still fills max_model_len as without speculation."""
    prompts = [list(range(5, 5 + n)) for n in (47, 58, 61, 62)]
    params = [SamplingParams(max_tokens=64 - len(p), temperature=0, ignore_eos=True)
              for p in prompts]
    outputs = {}
    for spec in (None, k):
        llm = make_llm(spec, max_model_len=64)
        try:
            outputs[spec] = run(llm, prompts, params)
        finally:
            llm.shutdown()
    assert outputs[k] == outputs[None]
    assert [len(p) + len(o) for p, o in zip(prompts, outputs[k], strict=True)] == [64] * 4


def test_many_requests_in_a_tight_pool_decode_as_without_speculation():
    """Eight requests in 40 blocks of 4 tokens, k = 3 and dummy drafts (most rejected): blocks
    given back after rejections go straight to other requests (and preemption), and every
    greedy output still equals decoding without speculation."""
    prompts = [[5 + i, 9, 17, 33 + i, 2, 77][: 3 + i % 4] for i in range(8)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outputs = {}
    for k in (None, 3):
        llm = make_llm(k, block_size=4, num_kv_blocks=40)
        try:
            outputs[k] = run(llm, prompts, params)
            stats = llm.engine.core.stats()
        finally:
            llm.shutdown()
    assert outputs[3] == outputs[None]
    assert stats.num_preemptions > 0 and stats.spec_num_draft_tokens > \
        stats.spec_num_accepted_tokens


def _sharpened(monkeypatch, factor: float) -> None:
    """Scale the dummy model's logits so that its next-token distributions have a few likely
    tokens (dummy weights give nearly uniform ones, under which no test could tell a biased
    sampler)."""
    compute = DeepseekForCausalLM.compute_logits
    monkeypatch.setattr(DeepseekForCausalLM, "compute_logits",
                        lambda self, hidden, dst=None: compute(self, hidden, dst) * factor)


def test_sampled_tokens_follow_the_distribution_without_speculation(reference, monkeypatch):
    """400 seeded samples of the first three tokens at temperature 0.8 and top-p 0.9, with
    and without speculation (oracle drafts of the greedy text, most accepted): the total
    variation between the two empirical distributions of each token stays under 0.12, where
    a sampler that kept every draft (or never the first token's own draw) is off by > 0.3."""
    _sharpened(monkeypatch, 60.0)
    prompt = "abc"
    params = [SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, seed=seed,
                             ignore_eos=True) for seed in range(400)]
    samples = {}
    for k in (None, 2):
        llm = make_llm(k, num_kv_blocks=512, max_num_seqs=400)
        try:
            if k is not None:
                ids = tuple(llm.tokenizer.encode(prompt))
                greedy = {ids: list(ids) + run(llm, [prompt], GREEDY)[0]}
                oracle(greedy, llm.engine.core.config.model.vocab_size, 10**9, monkeypatch)
            samples[k] = run(llm, [prompt] * len(params), params)
            if k is not None:
                assert llm.engine.core.stats().spec_num_accepted_tokens > 50
        finally:
            llm.shutdown()
    for position in range(3):
        plain = Counter(s[position] for s in samples[None])
        spec = Counter(s[position] for s in samples[2])
        assert max(plain.values()) < 0.9 * len(params)  # a distribution, not one token
        tv = sum(abs(plain[t] - spec[t]) for t in plain | spec) / (2 * len(params))
        assert tv < 0.12, (position, tv, plain.most_common(5), spec.most_common(5))


def test_the_cli_flag_is_vllms():
    from mlaserve.cli import build_parser, engine_args_from

    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "deepseek_mtp", '
         '"num_speculative_tokens": 3}'])
    assert engine_args_from(args).speculative_config == SpeculativeConfig("deepseek_mtp", 3)


def test_stop_strings_and_n_samples_end_as_without_speculation(reference, monkeypatch):
    """A stop string inside a run of accepted drafts ends the text where it ends without
    speculation; two samples of one prompt each decode as one alone."""
    plain = make_llm(None)
    try:
        text = plain.generate([PROMPTS[1]], GREEDY)[0].outputs[0].text
        stop = text[len(text) // 2: len(text) // 2 + 2]
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop], n=2)
        want = [(c.text, c.finish_reason) for c in
                plain.generate([PROMPTS[1]], params)[0].outputs]
    finally:
        plain.shutdown()
    llm = make_llm(3)
    try:
        oracle(reference, llm.engine.core.config.model.vocab_size, 10**9, monkeypatch)
        got = [(c.text, c.finish_reason) for c in llm.generate([PROMPTS[1]], params)[0].outputs]
        assert got == want and want[0][1] == "stop" and len(want) == 2
        assert llm.engine.core.stats().spec_num_accepted_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_gpu_speculation_replays_verify_graphs_and_equals_no_speculation():
    """On a GPU in float32 (no near-ties from bfloat16 rounding): the decode CUDA graphs of q_len
    k + 1, the drafting graphs (the recursive passes' too) and the greedy verification's capture
    and replay, and greedy outputs equal decoding without speculation."""
    options = dict(load_format="dummy", hf_overrides=OVERRIDES, device="cuda", dtype="float32",
                   block_size=16, num_kv_blocks=256)
    plain = LLM(**options)
    try:
        want = run(plain, PROMPTS, GREEDY)
    finally:
        plain.shutdown()
    llm = LLM(**options, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    try:
        assert run(llm, PROMPTS, GREEDY) == want
        graphs = llm.engine.runner.graphs
        assert graphs is not None and (4, 1) in graphs.graphs and graphs.num_replays > 0
        # drafting after plain decodes; verifying and drafting after full verifications
        assert llm.engine.runner.draft_graphs.num_replays > 0
        assert llm.engine.runner.verify_graphs["greedy"].num_replays > 0
        # passes 2..k after the prompts' eager steps
        assert llm.engine.runner.draft_graphs.recursive.num_replays > 0
        # a prompt alone: its prefill graph, then the drafting graph after it
        assert run(llm, PROMPTS[:1], GREEDY) == want[:1]
        assert llm.engine.runner.prefill_graphs.num_replays > 0
        assert llm.engine.runner.draft_graphs.after_prefill.num_replays > 0
        assert llm.engine.core.stats().spec_num_drafts > 0
    finally:
        llm.shutdown()


def test_a_speculating_engine_records_its_verification_steps_with_their_q_len(tmp_path,
                                                                               monkeypatch,
                                                                               reference):
    """`--record-decode-steps` under speculation: a verification step is a decode of q_len
    k + 1 (what `bench kernel --replay` times), each length counting the drafts."""
    from mlaserve.engine.decode_record import read_decode_steps

    path = tmp_path / "steps.jsonl"
    llm = make_llm(2, record_decode_steps=str(path))
    try:
        oracle(reference, llm.engine.core.config.model.vocab_size, 4, monkeypatch)
        run(llm, PROMPTS[:2], GREEDY)
    finally:
        llm.shutdown()
    steps = read_decode_steps(path)
    verifying = [step.seq_lens for step in steps if step.q_len == 3]
    assert verifying and all(n >= 3 for lens in verifying for n in lens)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["replicas", "expert_parallel"])
def test_data_parallel_replicas_each_speculate(expert_parallel: bool):
    """`serve --data-parallel-size 2 --speculative-config`, alone (replicas without expert
    parallelism are engines of their own) and with `--enable-expert-parallel` (every replica
    runs the MTP module's passes in lockstep, exchanging tokens in its MoE, an idle replica
    joining them): concurrent greedy completions of the demo model equal one process's
    without speculation, and /metrics sums both replicas' drafts."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from tests.test_server_lifecycle import serve, stop

    prompts = [f"What is {a} + {b}?" for a, b in [(12, 30), (7, 5), (40, 41), (3, 9)]]
    plain = LLM(device="cpu", num_kv_blocks=64, block_size=16)
    try:
        want = [o.outputs[0].text for o in plain.generate(
            prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    finally:
        plain.shutdown()

    proc, url = serve("--data-parallel-size", "2", "--speculative-config",
                      '{"method": "mtp", "num_speculative_tokens": 2}',
                      *(["--enable-expert-parallel"] if expert_parallel else []))
    try:
        def complete(prompt: str) -> str:
            r = requests.post(url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
                timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == want
        assert complete(prompts[1]) == want[1]  # alone: the other replica joins idle
        metrics = requests.get(url + "/metrics", timeout=10).text
        drafts = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and drafts[0] > 0, metrics[:2000]
    finally:
        stop(proc)


@pytest.mark.parametrize("where", [None, "launch", "collect"])
def test_speculating_steps_are_pipelined_and_survive_a_transient_fault(where, monkeypatch):
    """The demo model (its trained MTP layer, k = 3): a step is scheduled before the one in
    flight lands, verifying that step's drafts from the device with its positions corrected
    by its rejections there, and greedy outputs equal decoding without speculation. A fault
    at the fifth launch (or collect, with the next step already launched on its drafts) is
    taken back and re-run: the outputs stay the same."""
    prompts = [f"What is {a} + {b}?" for a, b in [(12, 30), (7, 5), (40, 41)]]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(device="cpu")
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    finally:
        plain.shutdown()
    from_device = []
    original = runner_module.from_previous_launch

    def counted(*args):
        found = original(*args)
        from_device.append(found is not None)
        return found

    monkeypatch.setattr(runner_module, "from_previous_launch", counted)
    llm = LLM(device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    try:
        runner = llm.engine.runner
        if where is not None:
            calls, method = [], getattr(runner, where)

            def fail_fifth_call(*args):
                calls.append(1)
                if len(calls) == 5:
                    raise RuntimeError("transient fault")
                return method(*args)

            monkeypatch.setattr(runner, where, fail_fifth_call)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        stats = llm.engine.core.stats()
    finally:
        llm.shutdown()
    assert got == want
    assert sum(from_device) >= 5  # the steady state: drafts verified straight from the device
    assert stats.spec_num_accepted_tokens > stats.spec_num_drafts  # well above one per step
