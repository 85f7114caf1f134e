"""Run the real server in-process on a free loopback port for tests (its engine core runs in a
child process), and helpers to inspect that process."""

import asyncio
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import requests

from mlaserve.engine.args import EngineArgs
from mlaserve.engine.core_process import FAULT_FILE_ENV
from mlaserve.engine.messages import SchedulerStats
from mlaserve.server.api import build_server, create_app
from mlaserve.server.state import ServerOptions

# Engine processes started by these tests watch this file (the core_process test hook).
FAULT_FILE = Path(tempfile.gettempdir()) / f"mlaserve-test-fault-{os.getpid()}"
os.environ[FAULT_FILE_ENV] = str(FAULT_FILE)


def fail_next_step(message: str) -> None:
    """Make the next step that an engine process started by these tests launches raise
    RuntimeError(message); later steps run normally."""
    FAULT_FILE.write_text(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """The live (non-zombie) child processes of `pid`, read from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            children.append(int(entry))
    return children


def engine_core_pids(server_pid: int) -> list[int]:
    """The engine-core processes that a server process started (spawned by multiprocessing)."""
    return [pid for pid in child_pids(server_pid) if b"spawn_main" in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""  # it exited meanwhile


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class RunningServer:
    """The server on the demo model; `options` are the API server's (ServerOptions)."""

    def __init__(self, api_key: str | None = None, options: ServerOptions | None = None,
                 grace_s: float = 5, served_model_name: str | tuple[str, ...] = "demo",
                 **engine_kwargs) -> None:
        engine_kwargs.setdefault("device", "cpu")
        engine_kwargs.setdefault("num_kv_blocks", 512)
        engine_kwargs.setdefault("block_size", 16)
        self.app = create_app(EngineArgs(**engine_kwargs), served_model_name, api_key, options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = build_server(self.app, host="127.0.0.1", port=self.port,
                                   log_level="warning", timeout_graceful_shutdown=grace_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    @property
    def engine(self):
        """The AsyncEngineClient (on the server thread's event loop)."""
        return self.state.engine

    def __enter__(self) -> "RunningServer":
        self.thread.start()
        deadline = time.time() + 120
        while time.time() < deadline and self.thread.is_alive():
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not become healthy: {self.state.load_error}")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def core_stats(self) -> SchedulerStats:
        """The engine core's stats, asked from its process."""
        future = asyncio.run_coroutine_threadsafe(self.engine.get_stats(), self.engine.loop)
        return future.result(30)

    def wait_idle(self, timeout: float = 30) -> SchedulerStats:
        """Wait until nothing is in flight and the core holds no request and no KV block;
        returns the core's last stats (the caller asserts on them)."""
        deadline = time.time() + timeout
        while True:
            stats = self.core_stats()
            idle = (self.engine.num_in_flight == 0 and stats.num_running == 0
                    and stats.num_waiting == 0 and stats.kv_usage == 0)
            if idle or time.time() > deadline:
                return stats
            time.sleep(0.05)
