"""The server's hard edges, each against the real server on the demo model: invalid text,
oversized bodies and prompts, request-supplied chat templates, unknown models, over-context
max_tokens, a full queue, disconnects, stalled readers, shutdown, auth and what responses reveal.
"""

import asyncio
import dataclasses
import json
import logging
import re
import socket
import threading
import time

import aiohttp
import msgspec
import pytest
import requests

from mlaserve.engine.args import DEMO_MODEL_DIR
from mlaserve.server.formatting import sse, usage
from mlaserve.server.protocol_stream import ChatStreamChoice, chunk_head
from mlaserve.server.state import ServerOptions
from tests.server_util import RunningServer

openai = pytest.importorskip("openai")  # test-only; absent on a bare GPU machine

MAX_MODEL_LEN = 1024
VOCAB = json.loads((DEMO_MODEL_DIR / "config.json").read_text())["vocab_size"]
OPTIONS = ServerOptions(max_waiting_requests=8, trust_request_chat_template=True,
                        chat_template_timeout_s=1.0, stream_send_timeout_s=1.0)
NESTED_LOOPS = ("{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}"
                "{% endfor %}")
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with RunningServer(options=OPTIONS, max_model_len=MAX_MODEL_LEN, max_num_seqs=4) as running:
        yield running


def post(server, path: str, body: object, **kwargs) -> requests.Response:
    data = json.dumps(body) if isinstance(body, dict) else body
    return requests.post(server.url + path, data=data, timeout=60,
                         headers={"Content-Type": "application/json", **kwargs})


def assert_error(response: requests.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text[:300]
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and error["message"]
    if param is not None:
        assert param in (error["param"] or ""), error
    return error


SURROGATE = '"a \\ud800 b"'  # JSON text: a lone surrogate escape
SURROGATE_BODIES = [
    ("/v1/completions", f'{{"prompt": {SURROGATE}}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", {SURROGATE}]}}', "prompt[1]"),
    ("/v1/completions", f'{{"prompt": "x", "stop": [{SURROGATE}]}}', "stop[0]"),
    ("/v1/completions", f'{{"prompt": "x", "model": {SURROGATE}}}', "model"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {SURROGATE}}}]}}',
     "messages[0].content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "x"}}], '
     f'"chat_template_kwargs": {{"x": {SURROGATE}}}}}', "chat_template_kwargs.x"),
    ("/tokenize", f'{{"prompt": {SURROGATE}}}', "prompt"),
    ("/tokenize", f'{{"prompt": "x", "model": {SURROGATE}}}', "model"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_BODIES)
def test_lone_surrogates_are_a_400_naming_the_field(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


def test_a_streamed_chunk_with_a_lone_surrogate_is_escaped_json() -> None:
    """Text msgspec refuses to encode (a lone surrogate, which no request can bring in but a
    chunk must survive) goes out as JSON with the escape, the chunk's fields in their order."""
    head = chunk_head("chatcmpl-1", "chat.completion.chunk", 7, "demo")
    event = sse(msgspec.structs.replace(head, choices=[ChatStreamChoice(
        0, {"content": "a \ud800"}, None, None)], usage=usage(3, 1)))
    assert event == (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,'
                     b'"model":"demo","choices":[{"index":0,"delta":{"content":"a \\ud800"},'
                     b'"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":3,'
                     b'"completion_tokens":1,"total_tokens":4}}\n\n')


def test_invalid_utf8_bytes_are_a_400(server):
    assert_error(post(server, "/v1/completions", b'{"prompt": "a \xff b"}'), 400)
    # UTF-8 of a surrogate code point (json.loads decodes it with surrogatepass)
    assert_error(post(server, "/v1/completions", b'{"prompt": "a \xed\xa0\x80 b"}'), 400)


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    limit = server.state.max_request_body_size
    assert limit == 4 * 2**20 + 192 * MAX_MODEL_LEN
    big = {"prompt": "x" * (limit + 10)}
    assert_error(post(server, "/v1/completions", big), 413)  # said by Content-Length

    def chunks():  # chunked transfer: no Content-Length, the bytes are counted
        yield b'{"prompt": "'
        for _ in range(limit // 2**16 + 2):
            yield b"x" * 2**16
        yield b'"}'

    assert_error(post(server, "/v1/completions", chunks()), 413)
    assert_error(post(server, "/tokenize", chunks()), 413)


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(server):
    text = "word " * (32 * MAX_MODEL_LEN // 5 + 1)  # past 32 characters per context token
    error = assert_error(post(server, "/v1/completions", {"prompt": text}), 400, "prompt")
    assert "characters" in error["message"]  # counted in characters: never tokenized
    for path, body, param in (("/tokenize", {"prompt": text}, "prompt"),
                              ("/v1/chat/completions",
                               {"messages": [{"role": "user", "content": text}]}, "messages")):
        assert "characters" in assert_error(post(server, path, body), 400, param)["message"]


def test_max_tokens_past_the_context_is_vllms_400(server):
    error = assert_error(post(server, "/v1/completions", {
        "prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN}), 400, "max_tokens")
    assert error["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: {MAX_MODEL_LEN}. This model's "
        f"maximum context length is {MAX_MODEL_LEN} tokens and your request has 3 input tokens "
        f"({MAX_MODEL_LEN} > {MAX_MODEL_LEN} - 3).")
    assert_error(post(server, "/v1/chat/completions", {
        "messages": USER, "max_completion_tokens": MAX_MODEL_LEN}), 400, "max_tokens")
    ok = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN - 3,
                                          "stop_token_ids": list(range(VOCAB))})
    assert ok.status_code == 200, ok.text


def test_unknown_model_is_a_404_that_openai_raises_as_not_found(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404,
                 "model")
    assert_error(post(server, "/tokenize", {"prompt": "x", "model": "gpt-9"}), 404, "model")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=USER, max_tokens=2)


def test_unknown_routes_and_methods_are_openai_errors(server):
    assert_error(requests.get(server.url + "/v1/nothing"), 404)
    assert_error(requests.get(server.url + "/v1/completions"), 405)
    assert_error(requests.put(server.url + "/tokenize"), 405)


def test_request_chat_templates_render_bounded(server):
    template = "{% for m in messages %}[{{ m.role }}]{{ m['content'] }}{% endfor %}"
    for body in ({"messages": USER, "chat_template": template},
                 {"messages": USER, "chat_template_kwargs": {"chat_template": template}}):
        tokens = post(server, "/tokenize", body).json()["tokens"]
        plain = post(server, "/tokenize", {"prompt": "[user]hi", "add_special_tokens": False})
        assert tokens == plain.json()["tokens"]
    bomb = {"messages": USER, "chat_template": "{{ 'x' * 100000000 }}"}
    assert_error(post(server, "/v1/chat/completions", bomb), 400, "chat_template")


def test_a_slow_template_never_blocks_the_server(server):
    """Nested loops run until the render deadline (1 s here) in a worker process, while /health
    keeps answering."""
    result = {}

    def slow():
        result["r"] = post(server, "/v1/chat/completions",
                           {"messages": USER, "chat_template": NESTED_LOOPS})

    thread = threading.Thread(target=slow)
    thread.start()
    answered = 0
    while thread.is_alive():
        assert requests.get(server.url + "/health", timeout=60).status_code == 200
        answered += thread.is_alive()  # answered while the template was rendering
        time.sleep(0.02)
    assert answered >= 2
    error = assert_error(result["r"], 400, "chat_template")
    assert "time budget" in error["message"]


def test_a_full_queue_answers_503_with_retry_after(server):
    """max_num_seqs (4) + max_waiting_requests (8) prompts are admitted; the next gets 503."""
    async def main():
        async with aiohttp.ClientSession() as session:
            async def one(i):
                body = {"prompt": f"q{i}", "max_tokens": 48, "ignore_eos": True}
                async with session.post(server.url + "/v1/completions", json=body) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            return await asyncio.gather(*(one(i) for i in range(20)))

    results = asyncio.run(main())
    refused = [r for r in results if r[0] == 503]
    assert len(refused) >= 4 and all(r[1] == "1" for r in refused)
    assert all(r[2]["error"]["type"] == "ServiceUnavailableError" for r in refused)
    assert all(r[2]["usage"]["completion_tokens"] == 48 for r in results if r[0] == 200)
    server.wait_idle()
    assert server.state.serving.num_admitted == 0


def raw_request(server, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """Send a POST on a plain socket (read nothing) and return the socket."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def wait_until_in_flight(server, count: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while server.engine.num_in_flight < count:
        assert time.time() < deadline, "the request never reached the engine"
        time.sleep(0.02)


def test_a_non_streaming_request_is_aborted_when_its_client_disconnects(server):
    server.wait_idle()
    sock = raw_request(server, {"prompt": "x", "max_tokens": 1000, "ignore_eos": True})
    wait_until_in_flight(server, 1)
    sock.close()
    stats = server.wait_idle(timeout=300)
    assert (stats.num_running, stats.kv_usage) == (0, 0.0)
    metrics = requests.get(server.url + "/metrics", timeout=60).text
    aborted = re.search(r'vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)',
                        metrics)
    assert float(aborted.group(1)) >= 1  # aborted, not run to its 1000 tokens


def test_a_stream_whose_client_stops_reading_is_aborted():
    """64 samples of one streamed request with 20 logprobs each fill the socket buffers within
    a few steps once the client stops reading; the send then times out
    (stream_send_timeout_s, 1 s here) and every sample is aborted long before its 1000 tokens.
    (This server lets one request hold every place it admits.)"""
    options = dataclasses.replace(OPTIONS, max_request_share=1.0)
    with RunningServer(options=options, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                       num_kv_blocks=64 * 64) as server:
        body = {"prompt": "x", "max_tokens": 1000, "n": 64, "ignore_eos": True,
                "stream": True, "logprobs": 20}
        sock = raw_request(server, body, rcvbuf=4096)
        try:
            wait_until_in_flight(server, 1)
            stats = server.wait_idle(timeout=60)
            assert (stats.num_running, stats.kv_usage) == (0, 0.0)
            assert server.engine.num_in_flight == 0
            metrics = requests.get(server.url + "/metrics", timeout=10).text
        finally:
            sock.close()
    aborted = re.search(r'vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)',
                        metrics)
    generated = re.search(r"vllm:generation_tokens_total\{[^}]*\} (\S+)", metrics)
    assert float(aborted.group(1)) == 64
    assert float(generated.group(1)) < 64 * 1000 / 2


def stream_events(server, body: dict, path: str = "/v1/completions") -> list[str]:
    with requests.post(server.url + path, json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        return [line[6:].decode() for line in r.iter_lines() if line.startswith(b"data: ")]


def test_innocent_streams_finish_while_hostile_requests_are_refused(server):
    server.wait_idle()
    outcomes: dict[str, list] = {"innocent": []}

    def innocent(i):
        body = {"prompt": f"innocent {i}", "max_tokens": 200, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with requests.post(server.url + "/v1/completions", json=body, stream=True) as r:
            events = [line for line in r.iter_lines() if line]
        usage = json.loads(events[-2][6:])["usage"]
        outcomes["innocent"].append((events[-1], usage["completion_tokens"]))

    threads = [threading.Thread(target=innocent, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    while server.state.serving.num_admitted < 10:  # all ten running or waiting in the core
        assert all(t.is_alive() for t in threads), "an innocent ended before all were admitted"
        time.sleep(0.01)
    flood: list[requests.Response] = []  # 10 innocents + 2 fill the 12 places
    flooders = [threading.Thread(target=lambda: flood.append(post(
        server, "/v1/completions", {"prompt": "flood", "max_tokens": 2}))) for _ in range(12)]
    for t in flooders:
        t.start()
    for t in flooders:
        t.join(60)
    hostile = {
        "surrogate": post(server, "/v1/completions", f'{{"prompt": {SURROGATE}}}'),
        "huge body": post(server, "/v1/completions",
                          {"prompt": "x" * (server.state.max_request_body_size + 1)}),
        "long template": post(server, "/v1/chat/completions",
                              {"messages": USER, "chat_template": NESTED_LOOPS}),
        "unknown model": post(server, "/v1/completions", {"prompt": "x", "model": "nope"}),
        "over-context max_tokens": post(server, "/v1/completions",
                                        {"prompt": "x", "max_tokens": 10**6}),
    }
    for t in threads:
        t.join(60)
    expected = {"surrogate": 400, "huge body": 413, "long template": 400,
                "unknown model": 404, "over-context max_tokens": 400}
    assert {k: r.status_code for k, r in hostile.items()} == expected
    assert sorted(r.status_code for r in flood) == [200] * 2 + [503] * 10, [
        r.status_code for r in flood]
    assert outcomes["innocent"] == [(b"data: [DONE]", 200)] * 10
    stats = server.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)


def test_models_root_schema_and_no_paths(server):
    card = requests.get(server.url + "/v1/models").json()["data"][0]
    assert card["root"] == str(DEMO_MODEL_DIR) and card["max_model_len"] == MAX_MODEL_LEN
    info = requests.get(server.url + "/tokenizer_info")
    assert info.status_code == 200 and info.json()["eos_token"]
    assert str(DEMO_MODEL_DIR) not in info.text and '"/' not in info.text
    schema = requests.get(server.url + "/openapi.json").json()
    assert '"422"' not in json.dumps(schema)
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "503"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]


def test_api_key_guards_the_v1_and_tokenizer_routes():
    with RunningServer(api_key="sekret", max_model_len=256) as keyed:
        good = {"Authorization": "Bearer sekret"}
        for method, path, body in (("post", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
                                   ("post", "/tokenize", {"prompt": "x"}),
                                   ("post", "/detokenize", {"tokens": [5]}),
                                   ("get", "/tokenizer_info", None),
                                   ("get", "/v1/models", None)):
            call = getattr(requests, method)
            assert_error(call(keyed.url + path, json=body), 401)
            assert_error(call(keyed.url + path, json=body,
                              headers={"Authorization": "Bearer sekreT"}), 401)
            assert call(keyed.url + path, json=body, headers=good).status_code == 200
        for path in ("/health", "/version", "/metrics", "/openapi.json"):
            assert requests.get(keyed.url + path).status_code == 200
        # a request-supplied chat template is refused without --trust-request-chat-template
        for body in ({"messages": USER, "chat_template": "{{ 1 }}"},
                     {"messages": USER, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}):
            assert_error(requests.post(keyed.url + "/v1/chat/completions", json=body,
                                       headers=good), 400, "chat_template")
            assert_error(requests.post(keyed.url + "/tokenize", json=body, headers=good), 400,
                         "chat_template")


def test_shutdown_ends_streams_with_an_error_event_and_done(caplog):
    """On SIGTERM (uvicorn's should_exit) a stream longer than the grace period (3 s here) gets
    an error event and [DONE] before the deadline; start-up logs where it serves and, while
    busy, a stats line."""
    options = ServerOptions(stats_interval_s=0.5)
    with caplog.at_level(logging.INFO, logger="mlaserve.server"):
        running = RunningServer(options=options, grace_s=3, max_model_len=1024)
        running.__enter__()
        events: list[list[str]] = []

        def stream():
            events.append(stream_events(running, {"prompt": "x", "max_tokens": 1000,
                                                    "ignore_eos": True, "stream": True}))

        threads = [threading.Thread(target=stream) for _ in range(2)]
        for t in threads:
            t.start()
        wait_until_in_flight(running, 2)
        time.sleep(1.0)  # a stats interval with traffic
        running.server.should_exit = True
        for t in threads:
            t.join(120)
        running.__exit__(None, None, None)
    # each stream's own ending (an error event, then [DONE]) came before the grace period's
    # end: the connection was not cut
    for received in events:
        assert received[-1] == "[DONE]"
        error = json.loads(received[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
    messages = [r.getMessage() for r in caplog.records]
    assert f"serving on {running.url} (model demo)" in messages
    assert any("generation throughput" in m for m in messages)
