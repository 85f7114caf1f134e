"""Stall benchmark: hostile inputs beside innocent streams, against a real server.

Usage: python scripts/stall_bench.py [--innocents 8] [--max-tokens 64] [--out FILE]
    [SERVE FLAGS ...]

Starts `mlaserve serve --device cpu` (the built-in demo model; extra arguments go to it, and the
inputs are sized against the default limits), then,
for each class of hostile input (`cases`: constraints past every limit or near them, compiles
abandoned by their clients, min_tokens against a complete constraint, request chat templates
that recurse, build huge integers or pad strings, one request asking for every admission
place, slow headers, slow bodies, client disconnects), runs `--innocents` greedy streams and,
while they run, the hostile requests. Printed per class: whether every hostile request got the
answer it should (a 400 naming the limit, a 408, a closed connection, or an answer), the
innocents' largest gap between two streamed tokens, and the largest /health latency (polled
every 50 ms). The first row runs the innocents alone. Target: no gap over 1 s caused by another
request's parsing, compiling or rendering.

tests/test_server_hostile_inputs.py runs the same cases (`cases`) against a server with scaled
limits and asserts their outcomes.
"""

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

from mlaserve.engine.structured_config import StructuredOutputsConfig

USER = [{"role": "user", "content": "hi"}]


@dataclass
class Limits:
    """What the server was started with (what the hostile inputs are sized against)."""

    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    max_per_request: int = 640  # --max-request-share x (--max-num-seqs + --max-waiting)
    header_read_timeout_s: float = 30.0
    body_read_timeout_s: float = 60.0


@dataclass
class Case:
    """One class of hostile input: `run(url)` sends it and returns what differed from the
    answers it should get (empty: all as expected)."""

    name: str
    run: Callable[[str], list[str]]


def post(url: str, path: str, body: dict, timeout: float = 300) -> requests.Response:
    return requests.post(url + path, json=body, timeout=timeout)


def check_error(response: requests.Response, status: int, fragment: str) -> list[str]:
    """Problems unless the response is an OpenAI error of `status` whose message (or param)
    holds `fragment`."""
    if response.status_code != status:
        return [f"status {response.status_code}, not {status}: {response.text[:200]}"]
    error = response.json().get("error", {})
    if fragment not in (error.get("message") or "") + (error.get("param") or ""):
        return [f"the error does not name {fragment!r}: {error}"]
    return []


def refused(path: str, body: dict, fragment: str, status: int = 400) -> Callable:
    return lambda url: check_error(post(url, path, body), status, fragment)


def answered_or_compile_limit(path: str, body: dict) -> Callable:
    """A constraint within the limits: answered, or refused for the sandbox's time or memory
    budget (which one a machine meets depends on its speed)."""
    def run(url: str) -> list[str]:
        response = post(url, path, body)
        if response.status_code == 200:
            return []
        problems = check_error(response, 400, "compile_")
        return problems and [f"neither answered nor a compile limit: {response.text[:200]}"]

    return run


def completion(**fields) -> dict:
    return {"prompt": "Q", "max_tokens": 4, **fields}


def chain_grammar(rules: int) -> str:
    """An EBNF grammar of `rules` rules, each leading to the next."""
    body = "\n".join(f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(rules - 2))
    return f'root ::= r0\n{body}\nr{rules - 2} ::= "end"'


def nested_schema(depth: int) -> dict:
    """A schema whose JSON text nests `depth` brackets deep."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def enum_values(count: int, tag: str = "") -> list[str]:
    return [f"{tag}value-{i}" for i in range(count)]


def concurrently(*runs: Callable[[], list[str]]) -> list[str]:
    """Run each in a thread of its own; their problems together."""
    problems: list[list[str]] = [[] for _ in runs]

    def one(i: int) -> None:
        try:
            problems[i] = runs[i]()
        except Exception as exc:  # noqa: BLE001 - reported as the case's problem
            problems[i] = [f"{type(exc).__name__}: {exc}"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [p for group in problems for p in group]


def abandoned(url: str, body: dict, after_s: float = 0.3) -> list[str]:
    """A request whose client gives up after `after_s` seconds (its compile is cancelled)."""
    try:
        post(url, "/v1/completions", body, timeout=after_s)
    except requests.Timeout:
        pass
    return []


def small_beside_heavy(heavy: dict) -> Callable:
    """A yes/no choice sent while a heavy constraint compiles: answered first."""
    def run(url: str) -> list[str]:
        order: list[str] = []

        def send(name: str, body: dict) -> list[str]:
            response = post(url, "/v1/completions", body)
            order.append(name)
            return [] if name == "heavy" or response.status_code == 200 else [
                f"the small constraint got {response.status_code}: {response.text[:200]}"]

        def small() -> list[str]:
            time.sleep(0.2)
            return send("small", completion(guided_choice=["yes", "no"], max_tokens=2))

        problems = concurrently(lambda: send("heavy", heavy), small)
        return problems + ([] if order[0] == "small" else [f"answered in order {order}"])

    return run


def min_tokens_against_a_complete_constraint(url: str) -> list[str]:
    bodies = [("/v1/completions", completion(guided_choice=["ab"], min_tokens=5, max_tokens=8)),
              ("/v1/completions", completion(guided_regex="a", min_tokens=5, n=3,
                                             max_tokens=8)),
              ("/v1/chat/completions", {"messages": USER, "min_tokens": 5, "max_tokens": 8,
                                        "response_format": {"type": "json_schema", "json_schema": {
                                            "name": "one", "schema": {"enum": [1]}}}})]
    problems = []
    for path, body in bodies:
        response = post(url, path, body)
        if response.status_code != 200:
            problems.append(f"{response.status_code}: {response.text[:200]}")
        elif any(c["finish_reason"] != "stop" for c in response.json()["choices"]):
            problems.append(f"not ended by the constraint: {response.text[:200]}")
    return problems


def template(source: str) -> dict:
    return {"messages": USER, "max_tokens": 2, "chat_template": source}


def slow_connections(url: str, count: int, body: bool, wait_s: float) -> list[str]:
    """`count` connections that send their headers (or, with `body`, their body) part way and
    stop; each must be closed (after a 408, for a body) within `wait_s` seconds."""
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)))
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        if body:
            head += b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro"
        sock.sendall(head)
        sock.settimeout(wait_s)
        sockets.append(sock)
    problems = []
    for sock in sockets:
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except TimeoutError:
            problems.append("a slow connection is still open")
        finally:
            sock.close()
        if body and not received.startswith(b"HTTP/1.1 408"):
            problems.append(f"a slow body got {received[:40]!r}, not a 408")
    return problems[:3]


def disconnects(url: str) -> list[str]:
    """Non-streaming requests and streams whose clients leave part way."""
    def leave_stream() -> list[str]:
        body = completion(max_tokens=200, ignore_eos=True, stream=True)
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 3:
                    break
        return []

    body = completion(max_tokens=200, ignore_eos=True)
    return concurrently(*[lambda: abandoned(url, body) for _ in range(5)],
                        *[leave_stream for _ in range(5)])


def cases(limits: Limits) -> list[Case]:
    """The hostile inputs, sized against the server's limits."""
    so = limits.structured
    chat, comp = "/v1/chat/completions", "/v1/completions"
    deep_tools = [{"type": "function", "function": {
        "name": "f", "parameters": nested_schema(so.max_json_depth + 1)}}]
    heavy_enum = {"enum": enum_values(so.max_alternatives - 1)}
    too_many_rules = chain_grammar(so.max_grammar_rules + 1)
    return [
        Case("grammar past max_bytes", refused(comp, completion(
            guided_grammar='root ::= "a"' + " " * so.max_bytes), "max_bytes")),
        Case("grammar past max_grammar_rules", refused(comp, completion(
            guided_grammar=too_many_rules), "max_grammar_rules")),
        Case("schema text past max_json_depth", refused(comp, completion(
            guided_json=json.dumps(nested_schema(so.max_json_depth + 1))), "max_json_depth")),
        Case("schema text nested 5000 deep", refused(comp, completion(
            guided_json="[" * 5000 + "]" * 5000), "nests too deeply")),
        Case("tool parameters past max_json_depth", refused(chat, {
            "messages": USER, "max_tokens": 4, "tools": deep_tools,
            "tool_choice": "required"}, "max_json_depth")),
        Case("enum past max_alternatives", refused(comp, completion(
            guided_json={"enum": enum_values(so.max_alternatives + 1)}), "max_alternatives")),
        Case("choices past max_alternatives", refused(comp, completion(
            guided_choice=enum_values(so.max_alternatives + 1)), "max_alternatives")),
        Case("regex past max_alternatives", refused(comp, completion(
            guided_regex="|".join(enum_values(so.max_alternatives + 1))), "max_alternatives")),
        Case("grammar at max_grammar_rules", answered_or_compile_limit(comp, completion(
            guided_grammar=chain_grammar(so.max_grammar_rules)))),
        Case("enum at max_alternatives", answered_or_compile_limit(comp, completion(
            guided_json=heavy_enum))),
        Case("4 heavy constraints abandoned", lambda url: concurrently(*[
            lambda i=i: abandoned(url, completion(guided_json={
                "enum": enum_values(so.max_alternatives - 1, f"gone{i}-")}))
            for i in range(4)])),
        Case("yes/no beside a heavy constraint", small_beside_heavy(completion(
            guided_choice=enum_values(so.max_alternatives - 1, "heavy-")))),
        Case("min_tokens against a complete constraint",
             min_tokens_against_a_complete_constraint),
        Case("template: macro recursion", refused(chat, template(
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"), "chat_template")),
        Case("template: 3000 nested parentheses", refused(chat, template(
            "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}"), "chat_template")),
        Case("template: 500 nested ifs", refused(chat, template(
            "{% if true %}" * 500 + "x" + "{% endif %}" * 500), "chat_template")),
        Case("template: big-integer power", refused(chat, template(
            "{% set x = 7 ** 1000 %}{{ (x ** 1000) % 10 }}"), "chat_template")),
        Case("template: 8 x expandtabs", lambda url: concurrently(*[
            lambda: check_error(post(url, chat, template(
                "{{ ('\\t' * 1000).expandtabs(1000) }}")), 400, "chat_template")
            for _ in range(8)])),
        Case("template: nested loops to the deadline", refused(chat, template(
            "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}"
            "{% endfor %}"), "time budget")),
        Case("n past the request share", refused(comp, completion(
            n=limits.max_per_request + 1), "max-request-share")),
        Case("slow headers (slowloris)", lambda url: slow_connections(
            url, 50, body=False, wait_s=limits.header_read_timeout_s + 30)),
        Case("slow bodies", lambda url: slow_connections(
            url, 10, body=True, wait_s=limits.body_read_timeout_s + 30)),
        Case("client disconnects", disconnects),
    ]


# ---- the benchmark ---------------------------------------------------------------------------
@dataclass
class Innocents:
    """Greedy streams run beside a case: their texts and the largest gap between two chunks."""

    texts: list[str] = field(default_factory=list)
    max_gap_s: float = 0.0
    errors: list[str] = field(default_factory=list)


def innocent_prompt(i: int) -> str:
    return f"Question: What is {12 + i} + {30 + 7 * i}?\nAnswer:"


def run_innocents(url: str, count: int, max_tokens: int) -> Innocents:
    """`count` greedy streams at once (ignore_eos, so each runs to max_tokens)."""
    result = Innocents(texts=[""] * count)
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"prompt": innocent_prompt(i), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, gap, last = "", 0.0, None
        try:
            with requests.post(url + "/v1/completions", json=body, stream=True,
                               timeout=300) as r:
                for line in r.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        gap = max(gap, now - last)
                    last = now
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(event["error"]["message"])
                    text += event["choices"][0]["text"]
        except Exception as exc:  # noqa: BLE001 - reported
            with lock:
                result.errors.append(f"innocent {i}: {type(exc).__name__}: {exc}")
        with lock:
            result.texts[i] = text
            result.max_gap_s = max(result.max_gap_s, gap)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return result


class HealthPoller:
    """Polls /health every 50 ms in a thread; `worst_s` is the slowest answer since reset."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst_s = 0.0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                ok = requests.get(self.url + "/health", timeout=60).status_code == 200
            except requests.RequestException:
                ok = False
            self.worst_s = max(self.worst_s, time.perf_counter() - start)
            self.failures += not ok
            self._stop.wait(0.05)

    def reset(self) -> None:
        self.worst_s, self.failures = 0.0, 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Row:
    case: str
    problems: list[str]
    innocents: Innocents
    health_worst_s: float
    seconds: float


def run_case(url: str, case: Case | None, poller: HealthPoller, innocents: int,
             max_tokens: int) -> Row:
    """The innocents, and beside them the case (None: the innocents alone)."""
    poller.reset()
    start = time.perf_counter()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(
        innocents=run_innocents(url, innocents, max_tokens)))
    thread.start()
    time.sleep(0.3)  # the innocents are streaming
    try:
        problems = case.run(url) if case is not None else []
    except Exception as exc:  # noqa: BLE001 - reported as the case's problem
        problems = [f"{type(exc).__name__}: {exc}"]
    thread.join()
    return Row(case.name if case else "innocents alone", problems, result["innocents"],
               poller.worst_s, time.perf_counter() - start)


def start_server(port: int, flags: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115 - the server writes it until it stops
    server = subprocess.Popen([sys.executable, "-m", "mlaserve", "serve", "--device", "cpu",
                               "--port", str(port), *flags], stdout=log, stderr=log)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except requests.RequestException:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}; see {log_path}")
        time.sleep(0.2)
    server.kill()
    raise RuntimeError(f"the server did not start; see {log_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--innocents", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--log", default="stall-bench-server.log")
    args, serve_flags = parser.parse_known_args()
    flags = ["--trust-request-chat-template", *serve_flags]
    server = start_server(args.port, flags, args.log)
    url = f"http://127.0.0.1:{args.port}"
    poller = HealthPoller(url)
    try:
        baseline = run_case(url, None, poller, args.innocents, args.max_tokens)
        rows = [baseline]
        for case in cases(Limits()):
            row = run_case(url, case, poller, args.innocents, args.max_tokens)
            if row.innocents.texts != baseline.innocents.texts:
                row.problems.append("an innocent's text differs from its run alone")
            rows.append(row)
            print(f"{row.case}: done in {row.seconds:.1f} s", file=sys.stderr)
    finally:
        poller.stop()
        server.terminate()
        server.wait(60)
    print("| input class | as expected | innocents' largest gap (s) | /health worst (s) |"
          " case time (s) |")
    print("|---|---|---|---|---|")
    for row in rows:
        ok = "yes" if not row.problems and not row.innocents.errors else "NO: " + "; ".join(
            row.problems + row.innocents.errors)[:200]
        print(f"| {row.case} | {ok} | {row.innocents.max_gap_s:.3f} | "
              f"{row.health_worst_s:.3f} | {row.seconds:.1f} |")
    tracebacks = open(args.log).read().count("Traceback")
    print(f"\nserver log: {tracebacks} tracebacks")


if __name__ == "__main__":
    main()
