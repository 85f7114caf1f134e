"""The tensor-parallel engine end to end on CPU (gloo, float32): `LLM(tensor_parallel_size=2)`
runs rank 0 in this process and spawns rank 1; its greedy outputs and prompt logprobs must be
those of one process, through chunked prefills and preemptions. A worker killed mid-generation,
or one whose step raises, must surface as one clear ParallelEngineError within seconds, with no
process left behind and the process groups left, so a later engine can start. `mlaserve serve
--tensor-parallel-size 2` launched by torchrun streams the one-process greedy completion and
leaves no process after SIGTERM; started alone, killing its worker stops the server with exit
code 1 and an error naming the worker.

Every test runs under a watchdog (`faulthandler.dump_traceback_later(..., exit=True)`): a hang
dumps the stacks and ends the run instead of blocking it.
"""

import faulthandler
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import requests
import torch.distributed as dist

from mlaserve import LLM, SamplingParams
from mlaserve.engine.request import StructuredOutputs
from mlaserve.engine.worker import ParallelEngineError
from tests.server_util import child_pids, engine_core_pids
from tests.test_server_lifecycle import serve, stop, stream_in_background, wait_gone
from tests.test_server_lm_eval import check_loglikelihoods

TEST_TIMEOUT_S = 180
# small blocks, a small KV pool and a small token budget: chunked prefills and preemptions
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=24,
              max_num_batched_tokens=16, max_model_len=256)
PROMPTS = [[5 + i, 9, 17, 33 + i, 2, 77, 100 + i] * (1 + i) for i in range(5)]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=3,
                        logprobs=2)
# rank 0's sampling state: seeded noise, filters, penalties, logit bias, min_tokens, a grammar
MIXED = [SamplingParams(max_tokens=12, temperature=0.8, seed=7),
         SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.5,
                        presence_penalty=0.5, min_tokens=3, logit_bias={7: 5.0}),
         SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=3,
                        structured_outputs=StructuredOutputs(choice=["yes", "no way"]))]


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _generate(model_dir, tensor_parallel_size: int):
    llm = LLM(str(model_dir), tensor_parallel_size=tensor_parallel_size, **ENGINE)
    try:
        outputs = llm.generate(PROMPTS, PARAMS)
        preemptions = llm.engine.core.scheduler.num_preemptions
        mixed = llm.generate(PROMPTS[: len(MIXED)], MIXED)
    finally:
        llm.shutdown()
    assert not dist.is_initialized()
    return outputs, preemptions, [o.token_ids for o in mixed]


@pytest.mark.parametrize("name", ["v2-greedy-nolora-untied", "v3-noaux-lora-yarn-sharded"])
def test_tp2_equals_one_process(name, checkpoint_dir):
    model_dir, _ = checkpoint_dir(name)
    expected, preemptions, expected_mixed = _generate(model_dir, 1)
    assert preemptions > 0  # the KV pool is small enough to exercise leaving and re-joining
    outputs, tp_preemptions, mixed = _generate(model_dir, 2)
    assert tp_preemptions == preemptions
    assert mixed == expected_mixed  # rank 0 samples for every rank
    for want, got in zip(expected, outputs, strict=True):
        assert got.token_ids == want.token_ids
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for want_entry, got_entry in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:],
                                         strict=True):
            assert want_entry.keys() & got_entry.keys()
            for token in want_entry.keys() & got_entry.keys():
                assert got_entry[token] == pytest.approx(want_entry[token], abs=1e-4)
        for want_entry, got_entry in zip(want.logprobs, got.logprobs, strict=True):
            for token in want_entry.keys() & got_entry.keys():
                assert got_entry[token] == pytest.approx(want_entry[token], abs=1e-4)


def _assert_stopped(llm: LLM, worker) -> None:
    """The engine is stopped: its worker is gone, the process groups are left, and a new
    request fails at once with the same kind of error."""
    assert not worker.is_alive()
    assert not dist.is_initialized()
    with pytest.raises(ParallelEngineError):
        llm.generate(PROMPTS[:1], PARAMS)


def test_a_killed_worker_is_one_clear_error_within_seconds(checkpoint_dir):
    model_dir, _ = checkpoint_dir("v2-greedy-nolora-untied")
    llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.core.workers.processes[0]
    core = llm.engine.core
    step = core.step
    steps = 0

    def step_and_kill():
        nonlocal steps
        steps += 1
        if steps == 4:  # kill it while this step runs (or just before its first collective)
            threading.Timer(0.01, os.kill, (worker.pid, signal.SIGKILL)).start()
        return step()

    core.step = step_and_kill
    start = time.monotonic()
    try:
        with pytest.raises(ParallelEngineError,
                           match=rf"worker 1 \(pid {worker.pid}\) died \(killed by SIGKILL\)"):
            llm.generate(PROMPTS[:2], SamplingParams(max_tokens=60, temperature=0,
                                                     ignore_eos=True))
        assert time.monotonic() - start < 60  # no hang
        _assert_stopped(llm, worker)
    finally:
        llm.shutdown()


def test_an_exception_in_a_worker_is_one_clear_error(checkpoint_dir):
    model_dir, _ = checkpoint_dir("v2-greedy-nolora-untied")
    llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.core.workers.processes[0]
    # the workers get bytes that are no step plan: decoding it raises in the worker alone
    broadcast = llm.engine.core.broadcast
    broadcast._encoder = SimpleNamespace(encode=lambda plan: msgspec.msgpack.encode(["no plan"]))
    start = time.monotonic()
    try:
        with pytest.raises(ParallelEngineError,
                           match=rf"worker 1 \(pid {worker.pid}\) failed: ValidationError"):
            llm.generate(PROMPTS[:2], PARAMS)
        assert time.monotonic() - start < 60  # no hang
        _assert_stopped(llm, worker)
    finally:
        llm.shutdown()


# ---- the server --------------------------------------------------------------------------------
def _tp_server() -> tuple:
    """`mlaserve serve --tensor-parallel-size 2` on the demo model: (process, url, engine-core
    pid, worker pid)."""
    proc, url = serve("--tensor-parallel-size", "2", "--served-model-name", "demo")
    (core_pid,) = engine_core_pids(proc.pid)
    (worker_pid,) = engine_core_pids(core_pid)  # spawned by the core, as the core by the server
    return proc, url, core_pid, worker_pid


def test_serve_tp2_under_torchrun_streams_the_one_process_completion_and_stops_cleanly(
        tmp_path):
    """`torchrun --nproc-per-node 2 -m mlaserve serve -tp 2`: rank 0 serves, rank 1 is its
    worker. Also lm-eval's loglikelihood run through the tensor-parallel server; SIGTERM to
    rank 0 stops both ranks and torchrun with status 0."""
    proc, url = serve("--tensor-parallel-size", "2", "--served-model-name", "demo", torchrun=2)
    ranks = child_pids(proc.pid)
    (rank0,) = [pid for pid in ranks if engine_core_pids(pid)]
    (worker_pid,) = [pid for pid in ranks if pid != rank0]
    (core_pid,) = engine_core_pids(rank0)
    assert engine_core_pids(core_pid) == []  # under torchrun the core spawns no worker
    try:
        r = requests.post(url + "/v1/completions", json={
            "prompt": "The cache", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}, stream=True, timeout=60)
        lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == b"data: [DONE]"
        text = "".join(json.loads(line[len(b"data: "):])["choices"][0]["text"]
                       for line in lines[:-1])
        llm = LLM(device="cpu", num_kv_blocks=64, block_size=16)
        expected = llm.generate("The cache", SamplingParams(max_tokens=12, temperature=0,
                                                            ignore_eos=True))[0]
        assert text == expected.text
        check_loglikelihoods(tmp_path, url)
        os.kill(rank0, signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_gone([rank0, core_pid, worker_pid]) == []  # the worker exited with the core
    finally:
        stop(proc)


def test_serve_tp2_stops_with_a_clear_error_when_a_worker_is_killed():
    proc, url, core_pid, worker_pid = _tp_server()
    try:
        stream, result = stream_in_background(url, 400)
        time.sleep(1.0)
        start = time.monotonic()
        os.kill(worker_pid, signal.SIGKILL)
        stream.join(60)
        assert proc.wait(30) == 1
        assert time.monotonic() - start < 60  # no hang
        output = proc.stdout.read().decode()
        assert (f"tensor-parallel worker 1 (pid {worker_pid}) died (killed by SIGKILL)"
                in output)
        error_events = [line for line in result["lines"] if b'"error"' in line]
        assert error_events and b"tensor-parallel worker 1" in error_events[0]
        assert result["lines"][-1] == b"data: [DONE]"
        assert wait_gone([core_pid, worker_pid]) == []
    finally:
        stop(proc)


def test_tp2_speculates_as_one_process():
    """`LLM(tensor_parallel_size=2, speculative_config=...)` on the demo model (its trained MTP
    layer, k = 2): rank 0 verifies and broadcasts the emitted tokens, both ranks draft. Greedy
    outputs equal one process without speculation through chunked prefills and preemptions;
    sampled, penalised and constrained requests equal one speculating process's."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    engine = dict(ENGINE, block_size=4, num_kv_blocks=14)
    prompts = [f"What is {a} + {b}?" for a, b in [(12, 30), (7, 5), (40, 41)]]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = {}
    for tp, speculative in [(1, None), (1, spec), (2, spec)]:
        llm = LLM(None, tensor_parallel_size=tp, speculative_config=speculative, **engine)
        try:
            results[tp, speculative is not None] = (
                [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)],
                [o.outputs[0].token_ids for o in llm.generate(prompts, MIXED)],
                llm.engine.core.stats())
        finally:
            llm.shutdown()
        assert not dist.is_initialized()
    plain, one, two = results[1, False], results[1, True], results[2, True]
    assert two[0] == plain[0] == one[0]
    assert two[1] == one[1]
    assert two[2].spec_num_accepted_tokens == one[2].spec_num_accepted_tokens > 0
    assert two[2].num_preemptions == one[2].num_preemptions > 0
