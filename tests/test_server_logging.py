"""What the server logs by default: where it listens once the model is loaded, and vLLM's
stats line every interval while it serves (at debug level once it has been idle)."""

import logging
import re
import time

import requests

from mlaserve.server.state import ServerOptions
from tests.server_util import RunningServer


def test_start_up_and_periodic_stats_lines(caplog):
    caplog.set_level(logging.INFO, logger="mlaserve")
    with RunningServer(options=ServerOptions(stats_interval_s=0.3)) as server:
        body = {"prompt": "The cache", "max_tokens": 8, "ignore_eos": True}
        assert requests.post(server.url + "/v1/completions", json=body, timeout=60).ok
        time.sleep(1.0)
        url = server.url
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("mlaserve")]
    assert f"serving on {url} (model demo)" in messages
    stats = [m for m in messages if m.startswith("Avg prompt throughput")]
    busy = [m for m in stats if not re.search(r"Avg generation throughput: 0\.0 tokens/s", m)]
    assert busy, stats  # the interval with the request reports its tokens
    assert re.search(r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%", busy[0])
