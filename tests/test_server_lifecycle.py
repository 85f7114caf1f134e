"""Server lifecycle: 503 while loading, graceful shutdown on SIGTERM/SIGINT with exit code 0."""

import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from mlaserve.engine.async_engine import AsyncEngine
from tests.server_util import RunningServer, free_port


def test_health_is_503_while_the_model_loads(monkeypatch):
    release = threading.Event()
    original = AsyncEngine.from_args

    def slow_load(args, warm_up=False):
        release.wait(60)
        return original(args, warm_up)

    monkeypatch.setattr(AsyncEngine, "from_args", staticmethod(slow_load))
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
        r = requests.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        release.set()
        while time.time() < deadline:
            if requests.get(server.url + "/health", timeout=1).status_code == 200:
                break
            time.sleep(0.1)
        assert requests.get(server.url + "/health").status_code == 200
    finally:
        release.set()
        server.__exit__(None, None, None)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_shutdown_finishes_in_flight_and_exits_0(sig):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlaserve", "serve", "--device", "cpu",
                             "--port", str(port), "--num-kv-blocks", "64", "--block-size", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.2)
        result = {}

        def in_flight():
            r = requests.post(url + "/v1/completions", json={
                "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True},
                stream=True, timeout=60)
            result["lines"] = [line for line in r.iter_lines() if line]

        worker = threading.Thread(target=in_flight)
        worker.start()
        time.sleep(1.0)
        proc.send_signal(sig)
        worker.join(60)
        assert proc.wait(60) == 0
        assert result["lines"][-1] == b"data: [DONE]"
        assert sum(1 for line in result["lines"] if b'"text"' in line) == 200  # finished
    finally:
        if proc.poll() is None:
            proc.kill()
