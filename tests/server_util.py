"""Run the real server in-process on a free loopback port for tests."""

import socket
import threading
import time

import requests
import uvicorn

from mlaserve.engine.engine import EngineArgs
from mlaserve.server.api import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, api_key: str | None = None, **engine_kwargs) -> None:
        engine_kwargs.setdefault("device", "cpu")
        engine_kwargs.setdefault("num_kv_blocks", 512)
        engine_kwargs.setdefault("block_size", 16)
        self.app = create_app(EngineArgs(**engine_kwargs), "demo", api_key)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    def __enter__(self) -> "RunningServer":
        self.thread.start()
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become healthy")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def wait_idle(self, timeout: float = 30) -> None:
        engine = self.state.engine.engine
        deadline = time.time() + timeout
        while time.time() < deadline and (engine.has_unfinished or engine.requests):
            time.sleep(0.05)
