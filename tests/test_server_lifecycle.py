"""Server lifecycle: 503 while loading; graceful SIGTERM/SIGINT with exit code 0 and no child
process left; a model load error or a killed engine process stops the server with an error; a
killed server leaves no engine process behind."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import requests

from mlaserve.engine.core_client import AsyncEngineClient
from tests.server_util import RunningServer, child_pids, engine_core_pids, free_port, is_alive


def test_health_is_503_while_the_model_loads(monkeypatch):
    release = threading.Event()
    original = AsyncEngineClient.start

    async def slow_start(*args, **kwargs):
        await asyncio.to_thread(release.wait, 60)
        return await original(*args, **kwargs)

    monkeypatch.setattr(AsyncEngineClient, "start", slow_start)
    server = RunningServer()
    server.thread.start()
    try:
        deadline = time.time() + 60
        status = None
        while time.time() < deadline:
            try:
                status = requests.get(server.url + "/health", timeout=1).status_code
                break
            except requests.ConnectionError:
                time.sleep(0.1)
        assert status == 503
        assert requests.post(server.url + "/ping", timeout=5).status_code == 503
        r = requests.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        # the context length is known before the engine is: the model's config says it
        card = requests.get(server.url + "/v1/models", timeout=5).json()["data"][0]
        assert card["max_model_len"] == 1024  # the demo model's max_position_embeddings
        release.set()
        while time.time() < deadline:
            if requests.get(server.url + "/health", timeout=1).status_code == 200:
                break
            time.sleep(0.1)
        assert requests.get(server.url + "/health").status_code == 200
        assert requests.post(server.url + "/ping").status_code == 200
    finally:
        release.set()
        server.__exit__(None, None, None)


def serve(*extra: str, torchrun: int = 0) -> tuple[subprocess.Popen, str]:
    """`mlaserve serve` on the demo model in a subprocess, and its URL once healthy; with
    `torchrun` N, run by `torchrun --nproc-per-node N` (the subprocess is torchrun's)."""
    port = free_port()
    launcher = [sys.executable, "-m"]
    if torchrun:
        launcher += ["torch.distributed.run", "--nproc-per-node", str(torchrun),
                     "--master-port", str(free_port()), "-m"]
    proc = subprocess.Popen([*launcher, "mlaserve", "serve", "--device", "cpu",
                             "--port", str(port), "--num-kv-blocks", "64", "--block-size", "16",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                break
        except requests.RequestException:  # not listening yet, or busy starting
            time.sleep(0.2)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of a `serve` subprocess and every process under it: a failed
    test must not leave ranks or engine cores running (torchrun puts each rank in a process
    group of its own and, killed with SIGKILL, does not pass the signal on)."""
    if proc.poll() is not None:
        return  # exited (and reaped: its pid may be another process's now)
    tree, pending = [], [proc.pid]
    while pending:  # the descendants, found while their parents still live
        children = child_pids(pending.pop())
        tree += children
        pending += children
    for pid in [proc.pid, *tree]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it has exited
    proc.wait(30)


def stream_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """POST a streamed completion on a thread; its SSE lines land in result["lines"]."""
    result = {}

    def run():
        r = requests.post(url + "/v1/completions", json={
            "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True},
            stream=True, timeout=60)
        result["lines"] = [line for line in r.iter_lines() if line]

    worker = threading.Thread(target=run)
    worker.start()
    return worker, result


def wait_gone(pids: list[int], timeout: float = 15) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline and any(is_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if is_alive(p)]


def test_graceful_shutdown_finishes_in_flight_and_exits_0():
    """Ctrl-C (SIGINT). SIGTERM takes the same path (one handler for both, cli.py); its exit
    status 0 with no process left is checked by the parallel-serving tests."""
    sig = signal.SIGINT
    # A grace period well past the stream's time on a loaded machine (200 tokens take a few
    # seconds alone): this test is about the drain finishing a stream, not about its deadline
    proc, url = serve("--shutdown-timeout", "120")
    try:
        children = child_pids(proc.pid)
        assert len(engine_core_pids(proc.pid)) == 1
        worker, result = stream_in_background(url, 200)
        time.sleep(1.0)
        proc.send_signal(sig)
        worker.join(120)
        assert proc.wait(120) == 0
        assert result["lines"][-1] == b"data: [DONE]"
        text_lines = [line for line in result["lines"] if b'"text"' in line]
        assert b'"finish_reason":"length"' in text_lines[-1]  # finished, not cut
        assert wait_gone(children) == []  # the engine core (and any helper) exited too
    finally:
        stop(proc)


def test_killing_the_engine_process_fails_requests_and_stops_the_server():
    proc, url = serve()
    try:
        (core_pid,) = engine_core_pids(proc.pid)
        worker, result = stream_in_background(url, 400)
        time.sleep(1.0)
        os.kill(core_pid, signal.SIGKILL)
        worker.join(60)
        assert proc.wait(60) == 1
        output = proc.stdout.read().decode()
        assert "the engine process exited with code -9 (SIGKILL)" in output
        error_events = [line for line in result["lines"] if b'"error"' in line]
        assert error_events and b"exited with code -9" in error_events[0]
        assert result["lines"][-1] == b"data: [DONE]"
    finally:
        stop(proc)


def test_the_engine_process_exits_when_the_server_is_killed():
    proc, _ = serve()
    try:
        core_pids = engine_core_pids(proc.pid)
        assert len(core_pids) == 1
        proc.kill()
        proc.wait(10)
        assert wait_gone(core_pids) == []  # it noticed its parent die; no orphan is left
    finally:
        stop(proc)


def test_a_model_load_error_stops_the_server_with_exit_code_2():
    proc, _ = serve("--attention-backend", "FLASH_ATTN_MLA")
    try:
        assert proc.wait(60) == 2
        output = proc.stdout.read().decode()
        assert "the model failed to load" in output
        assert "FlashAttention MLA is not bundled" in output
    finally:
        stop(proc)
