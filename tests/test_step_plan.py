"""The step plan (step_plan.py): what every rank's runner executes. A plan round-trips through
msgspec, and two runners fed the same plans hold the same state and build the same inputs,
step for step: the property that lets one core drive any number of ranks."""

import msgspec
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.engine.runner import load_runner
from mlaserve.engine.step_plan import PlanBuilder, StepPlan

PROMPTS = ["The latent cache holds", "Hello", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
           "A list of", "Question: What is 2 + 3?\nAnswer:"]


def record_plans(llm: LLM) -> list[bytes]:
    """Generate with preemption, chunked prefill, prefix hits and finishes of every kind, and
    return every plan the core launched, msgpack-encoded."""
    runner = llm.engine.core.runner
    launch = runner.launch
    plans: list[bytes] = []

    def recording(plan, *args):
        encoded = msgspec.msgpack.encode(plan)
        assert msgspec.msgpack.decode(encoded, type=StepPlan) == plan  # round trip
        plans.append(encoded)
        return launch(plan, *args)

    runner.launch = recording
    try:
        params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=9, temperature=1.0, seed=3, top_p=0.8),
                  SamplingParams(max_tokens=30, temperature=0.7, seed=1, logprobs=2,
                                 prompt_logprobs=1, repetition_penalty=1.2),
                  SamplingParams(max_tokens=5, temperature=0, stop=["3"]),
                  SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, n=2)]
        llm.generate(PROMPTS, params)
        llm.generate(PROMPTS[:2], params[:2])  # prefix hits on the second round
    finally:
        runner.launch = launch
    return plans


def runner_state(runner) -> dict:
    return {request_id: (r.row, list(r.block_ids), list(r.token_ids), r.num_computed_tokens,
                         r.num_output_placeholders, r.num_prompt_logprobs)
            for request_id, r in runner.requests.items()}


def test_two_runners_fed_the_same_plans_build_the_same_inputs(checkpoint_dir):
    path, _ = checkpoint_dir("v3-random-demo-vocab")
    # a small pool and token budget: preemption and chunked prefill happen
    llm = LLM(str(path), device="cpu", num_kv_blocks=12, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=16)
    plans = record_plans(llm)
    assert len(plans) > 20
    decoded = [msgspec.msgpack.decode(p, type=StepPlan) for p in plans]
    joined = [n.request_id for p in decoded for n in p.new_requests]
    assert len(joined) > len(set(joined)), "no request left the batch and came back"
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert any(s.num_computed_tokens for p in decoded for s in p.prefills)  # chunks, prefix hits
    first, second = (load_runner(llm.engine.core.config, torch.device("cpu")) for _ in range(2))
    pending = [None, None]
    for plan in decoded:
        launched = [runner.launch(msgspec.msgpack.decode(msgspec.msgpack.encode(plan),
                                                         type=StepPlan))
                    for runner in (first, second)]
        assert runner_state(first) == runner_state(second)
        assert torch.equal(first.inputs.block_table, second.inputs.block_table)
        for name in ("temperature", "top_p", "min_p", "top_k", "seeds"):
            assert torch.equal(getattr(first.inputs.params, name),
                               getattr(second.inputs.params, name)), name
        results = [runner.collect(p) if p is not None else None
                   for runner, p in zip((first, second), pending, strict=True)]
        assert results[0] == results[1]
        pending = launched
    assert first.collect(pending[0]) == second.collect(pending[1])


def test_the_builder_sends_only_what_changed():
    from mlaserve.engine.request import Request

    builder = PlanBuilder()
    request = Request("a", None, [1, 2, 3], SamplingParams(max_tokens=4), sample_seed=7,
                      eos_token_ids=(0,))
    request.block_ids = [4]
    first = builder.plan([], [(request, 3)], [request])
    assert [n.request_id for n in first.new_requests] == ["a"]
    assert first.prefills[0].new_block_ids == [4] and first.sampling == ["a"]
    request.num_computed_tokens, request.output_token_ids = 3, [9]
    second = builder.plan([request], [], [request])
    assert not second.new_requests
    assert (second.decodes[0].new_token_ids, second.decodes[0].new_block_ids) == ([9], [])
    builder.release("a")
    builder.release("a")  # once
    third = builder.plan([request], [], [])
    assert third.finished == ["a"] and [n.request_id for n in third.new_requests] == ["a"]
    assert third.decodes[0].new_token_ids == [9]  # sent anew, whole
