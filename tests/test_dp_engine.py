"""Data-parallel serving end to end on CPU (gloo, float32): `mlaserve serve --data-parallel-size 2
--enable-expert-parallel` runs two engine cores whose MoE layers exchange tokens, alone and with
`--tensor-parallel-size 2` inside each replica (four ranks, on a DeepSeek-V2 checkpoint; the
demo model has the V3 layout). Concurrent requests of different
lengths (so one replica often idles while the other decodes, and joins its expert exchanges
with an empty batch) must give the one-process greedy completions and prompt logprobs within
1e-4; lm-eval's loglikelihoods through the server must equal the one-process engine's. SIGTERM
stops every process; killing one replica's engine core stops the server with exit code 1 and an
error naming it, and leaves no process behind.

Every test runs under a watchdog: a hang dumps the stacks and ends the run instead of blocking.
"""

import faulthandler
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from mlaserve import LLM, SamplingParams
from mlaserve.engine.data_parallel import LoadBalancer
from tests.conftest import DEMO_TOKENIZER
from tests.server_util import child_pids, engine_core_pids
from tests.test_server_lifecycle import serve, stop, stream_in_background, wait_gone
from tests.test_server_lm_eval import check_loglikelihoods

TEST_TIMEOUT_S = 240
PROMPTS = [[5 + i, 9, 17, 33 + i, 2, 77, 100 + i] * (1 + i) for i in range(6)]
MAX_TOKENS = [3, 12, 5, 9, 2, 7]  # unequal: replicas finish at different steps


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_the_load_balancer_fills_replicas_evenly():
    balancer = LoadBalancer(3)
    assert [balancer.choose() for _ in range(4)] == [0, 1, 2, 0]
    balancer.release(1)
    balancer.release(2)
    assert balancer.choose() == 1  # fewest in flight, the first after the last chosen
    assert balancer.choose() == 2
    assert balancer.in_flight == [2, 1, 1]


def _complete(url: str, prompt: list[int], max_tokens: int) -> tuple[str, list[float]]:
    """Greedy completion of token ids, echoed: (the text, the logprob of every token after the
    first, prompt and generated)."""
    r = requests.post(url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "echo": True, "logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"][1:]


def _expected(model_dir) -> list[tuple[str, list[float]]]:
    llm = LLM(str(model_dir) if model_dir else None, device="cpu", num_kv_blocks=64,
              block_size=16)
    outputs = llm.generate(PROMPTS, [SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
        for n in MAX_TOKENS])
    return [(o.text, [entry[token] for entry, token in zip(
        o.prompt_logprobs[1:] + o.logprobs, prompt[1:] + o.token_ids, strict=True)])
        for o, prompt in zip(outputs, PROMPTS, strict=True)]


def _check_concurrent_requests(url: str, model_dir) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(_complete, [url] * len(PROMPTS), PROMPTS, MAX_TOKENS))
    for (want_text, want_logprobs), (text, logprobs) in zip(_expected(model_dir), results,
                                                            strict=True):
        assert text.endswith(want_text)  # echoed: the prompt's text, then the completion
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_serve_dp2_expert_parallel_equals_one_process_and_dies_cleanly(tmp_path):
    """The demo model (DeepSeek-V3 layout, 8 routed experts: 4 per replica): concurrent
    completions and lm-eval's loglikelihoods through the server; then one replica's core is
    killed mid-stream."""
    proc, url = serve("--data-parallel-size", "2", "--enable-expert-parallel",
                      "--served-model-name", "demo")
    try:
        cores = engine_core_pids(proc.pid)
        everything = child_pids(proc.pid)
        assert len(cores) == 2
        _check_concurrent_requests(url, None)
        check_loglikelihoods(tmp_path, url)
        streams = [stream_in_background(url, 400) for _ in range(2)]  # one per replica
        time.sleep(1.0)
        start = time.monotonic()
        os.kill(cores[1], signal.SIGKILL)
        for stream, _ in streams:
            stream.join(60)
        assert proc.wait(30) == 1
        assert time.monotonic() - start < 60  # no hang
        output = proc.stdout.read().decode()
        assert "the engine process of replica 1 exited with code -9 (SIGKILL)" in output
        for _, result in streams:
            assert any(b'"error"' in line for line in result["lines"])
            assert result["lines"][-1] == b"data: [DONE]"
        assert wait_gone(everything) == []
    finally:
        stop(proc)


def test_serve_tp2_by_dp2_expert_parallel_equals_one_process(checkpoint_dir):
    """Four ranks, two replicas of two, on a DeepSeek-V2 checkpoint: each replica's ranks hold
    half the columns of 4 of the 8 routed experts; SIGTERM stops every process."""
    model_dir, _ = checkpoint_dir("v2-greedy-nolora-untied")
    proc, url = serve(str(model_dir), "--tokenizer", str(DEMO_TOKENIZER),
                      "--data-parallel-size", "2", "--enable-expert-parallel",
                      "--tensor-parallel-size", "2")
    try:
        cores = engine_core_pids(proc.pid)
        workers = [w for core in cores for w in engine_core_pids(core)]
        assert len(cores) == 2 and len(workers) == 2
        _check_concurrent_requests(url, model_dir)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_gone(cores + workers) == []
    finally:
        stop(proc)
