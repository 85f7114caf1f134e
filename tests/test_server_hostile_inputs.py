"""Every class of hostile input against a real server (`mlaserve serve` in a subprocess, demo
model, CPU), with innocent greedy streams running beside them the whole time.

The inputs are scripts/stall_bench.py's (`cases`), sized against limits scaled down so that the
test stays quick and safe on a 2-core machine: constraints past each limit and at them, heavy
compiles abandoned by their clients, a small constraint beside a heavy one, min_tokens against
a complete constraint, request chat templates that recurse, nest, build huge integers, pad
strings or loop to the deadline, one request asking for more than its share of the admission
bound, slow headers, slow bodies and client disconnects. Asserted, never a clock: each answer
(a 400 that names the limit, a 408, a closed connection, or an answer), the engine process
alive, every innocent stream complete and equal to its output alone, the resident memory of the
API process and of the engine within a stated bound of where they were after warm-up, and a log
without tracebacks.
"""

import re
import threading
from pathlib import Path

import msgspec
import requests

from mlaserve.engine.structured_config import StructuredOutputsConfig
from tests.scripts_util import load_script
from tests.server_util import engine_core_pids, free_port, is_alive

stall_bench = load_script("stall_bench")

# a constraint at max_alternatives compiles for about a second here (beside it, a yes/no choice
# must be answered first)
STRUCTURED = StructuredOutputsConfig(max_json_depth=24, max_alternatives=20_000,
                                     max_grammar_rules=300, compile_timeout_s=30,
                                     compile_memory_mb=512, cache_mb=16)
LIMITS = stall_bench.Limits(structured=STRUCTURED, max_per_request=16,  # 0.5 x (16 + 16)
                            header_read_timeout_s=1.0, body_read_timeout_s=1.0)
FLAGS = ["--num-kv-blocks", "256", "--block-size", "16", "--max-num-seqs", "16",
         "--max-waiting-requests", "16", "--max-request-share", "0.5",
         "--chat-template-timeout", "1", "--header-read-timeout", "1",
         "--body-read-timeout", "1", "--disable-log-stats",
         "--structured-outputs-config", msgspec.json.encode(STRUCTURED).decode()]
INNOCENTS, INNOCENT_TOKENS = 4, 24
# innocent rounds before memory is measured: the engine's resident size grows by ~45 MiB over
# its first ~40 rounds (KV blocks touched for the first time), then stays flat; 20 rounds take
# most of it, and the bound below the rest
WARM_UP_ROUNDS = 20
# growth of the resident set allowed over the hostile inputs (the engine keeps at most
# cache_mb = 16 MiB of compiled grammars; everything else a hostile request brings is freed or
# never built)
API_RSS_GROWTH_MIB = 48
ENGINE_RSS_GROWTH_MIB = 48


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def test_hostile_inputs_beside_innocent_streams(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    server = stall_bench.start_server(port, ["--trust-request-chat-template", *FLAGS],
                                      str(log_path))
    try:
        (engine,) = engine_core_pids(server.pid)  # before any template renderer starts
        alone = stall_bench.run_innocents(url, INNOCENTS, INNOCENT_TOKENS)
        assert not alone.errors and all(alone.texts), alone
        # warm-up: both sandbox lanes' workers and the compile threads start, and the engine
        # reaches the resident size that serving brings it to (its KV blocks touched)
        warm = [stall_bench.completion(guided_choice=["yes", "no"]),
                stall_bench.completion(guided_choice=stall_bench.enum_values(2000, "warm"))]
        for body in warm:
            assert stall_bench.post(url, "/v1/completions", body).status_code == 200
        for _ in range(WARM_UP_ROUNDS):
            stall_bench.run_innocents(url, INNOCENTS, INNOCENT_TOKENS)
        rss_before = rss_mib(server.pid), rss_mib(engine)

        rounds: list[stall_bench.Innocents] = []
        done = threading.Event()

        def innocents() -> None:  # round after round, until the cases are done
            while not done.is_set():
                rounds.append(stall_bench.run_innocents(url, INNOCENTS, INNOCENT_TOKENS))

        runner = threading.Thread(target=innocents)
        runner.start()
        problems = {}
        try:
            for case in stall_bench.cases(LIMITS):
                problems[case.name] = case.run(url)
        finally:
            done.set()
            runner.join()
        assert {name: p for name, p in problems.items() if p} == {}
        assert len(rounds) >= 2
        for round_ in rounds:
            assert not round_.errors, round_.errors
            assert round_.texts == alone.texts

        assert is_alive(engine) and server.poll() is None
        assert requests.get(url + "/health", timeout=10).status_code == 200
        rss_after = rss_mib(server.pid), rss_mib(engine)
        print(f"RSS MiB, API {rss_before[0]:.0f} -> {rss_after[0]:.0f}, engine "
              f"{rss_before[1]:.0f} -> {rss_after[1]:.0f}")
        assert rss_after[0] - rss_before[0] < API_RSS_GROWTH_MIB
        assert rss_after[1] - rss_before[1] < ENGINE_RSS_GROWTH_MIB
    finally:
        server.terminate()
        server.wait(60)
    log = log_path.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "a client disconnected before its answer" in log  # one INFO line a disconnect
