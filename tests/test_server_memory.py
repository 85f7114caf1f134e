"""The API server's memory stays bounded when clients send huge bodies: 10 clients at once
each send 50 MB (half with a Content-Length, half chunked); every one gets a 413 and the
server process's peak RSS grows by little more than the body limit per connection."""

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import requests

from tests.server_util import free_port

BODY_MB = 50
NUM_CLIENTS = 10
CHUNK = b"x" * 2**20


def peak_rss_mib(pid: int) -> float:
    """VmHWM (peak resident set) of a process, in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


async def send_huge_body(session: aiohttp.ClientSession, url: str, chunked: bool) -> int:
    async def body():
        yield b'{"prompt": "'
        for _ in range(BODY_MB):
            yield CHUNK
            await asyncio.sleep(0)
        yield b'"}'

    headers = {"Content-Type": "application/json"}
    if not chunked:
        headers["Content-Length"] = str(BODY_MB * len(CHUNK) + 15)
    try:
        async with session.post(url + "/v1/completions", data=body(), headers=headers) as r:
            assert r.headers["content-type"].startswith("application/json")
            assert (await r.json())["error"]["code"] == 413
            return r.status
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
        # The server answered 413 and closed the connection while the client was still
        # sending; aiohttp then reports the broken pipe instead of the response.
        return 413


async def flood(url: str) -> list[int]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(send_huge_body(session, url, chunked=i % 2 == 1)
                                      for i in range(NUM_CLIENTS)))


def test_ten_50mb_bodies_at_once_leave_the_servers_memory_bounded():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "mlaserve", "serve", "--device", "cpu",
                               "--port", str(port), "--num-kv-blocks", "64", "--block-size",
                               "16", "--max-model-len", "1024"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        body = {"prompt": "warm", "max_tokens": 2}
        assert requests.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        before = peak_rss_mib(server.pid)
        statuses = asyncio.run(flood(url))
        after = peak_rss_mib(server.pid)
        assert statuses == [413] * NUM_CLIENTS
        limit_mib = (4 * 2**20 + 192 * 1024) / 2**20  # the default body limit at 1024 tokens
        print(f"API server peak RSS {before:.0f} -> {after:.0f} MiB for {NUM_CLIENTS} x "
              f"{BODY_MB} MB bodies (limit {limit_mib:.1f} MiB each)")
        assert after - before < NUM_CLIENTS * limit_mib + 64
        # and the server still serves
        assert requests.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.terminate()
        server.wait(30)
