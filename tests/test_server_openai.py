"""The real server (its engine core in a child process) driven by the openai package, raw HTTP,
and concurrent streams."""

import asyncio
import json

import aiohttp
import pytest
import requests

from mlaserve import LLM, SamplingParams
from tests.server_util import RunningServer, fail_next_step


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


@pytest.fixture(scope="module")
def client(demo_client):
    return demo_client


def test_completion_matches_the_engine(server, client):
    reference = LLM(device="cpu", num_kv_blocks=64, block_size=16).generate(
        ["The cache"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    out = client.completions.create(model="demo", prompt="The cache", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == reference.text
    assert out.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"


def test_logit_bias_steers_greedy_decoding(server, client):
    token = server.engine.tokenizer.decode([77])
    out = client.completions.create(model="demo", prompt="The cache", max_tokens=6,
                                    temperature=0, logit_bias={"77": 100}, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].logprobs.tokens == [token] * 6
    chat = client.chat.completions.create(model="demo", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          logit_bias={"77": 100}, logprobs=True)
    assert [entry.token for entry in chat.choices[0].logprobs.content] == [token] * 4


def test_streaming_completion_with_usage(client):
    chunks = list(client.completions.create(
        model="demo", prompt="Hello", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    # one chunk per generated token, unless the stream lagged and deltas merged
    assert 1 <= len(text_chunks) <= 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert text_chunks[-1].choices[0].finish_reason == "length"
    full = client.completions.create(model="demo", prompt="Hello", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    full = client.chat.completions.create(model="demo", messages=messages, max_tokens=5,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model="demo", messages=messages, max_completion_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5 == full.usage.completion_tokens


def test_logprobs_and_echo_for_loglikelihood(server, client):
    ids = [5, 60, 200, 31, 7]
    out = client.completions.create(model="demo", prompt=[ids], max_tokens=1, temperature=0,
                                    logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == len(ids) + 1  # the prompt, then one generated token
    reference = LLM(device="cpu", num_kv_blocks=64, block_size=16).generate(
        [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(reference.prompt_logprobs[i][ids[i]],
                                                     abs=1e-5)
        # top-1 comes from the same float arithmetic as the reference (lm-eval's is_greedy)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(
            max(reference.prompt_logprobs[i].values()), abs=1e-5)
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user",
                                          "content": "x"}], max_tokens=3, logprobs=True,
                                          top_logprobs=2, temperature=0,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_stop_strings_are_cut(client):
    full = client.completions.create(model="demo", prompt="Stop here", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[4:6]
    cut = client.completions.create(model="demo", prompt="Stop here", max_tokens=12,
                                    temperature=0, stop=["zzzz", "yyyy", "xxxx", "wwww", stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_models_tokenizer_and_aux_routes(server):
    models = requests.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "demo" and models["data"][0]["root"]
    assert requests.get(server.url + "/version").json()["version"]
    tok = requests.post(server.url + "/tokenize",
                        json={"prompt": "test", "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    info = requests.get(server.url + "/tokenizer_info").json()
    eos = requests.post(server.url + "/tokenize", json={"prompt": info["eos_token"],
                                                        "add_special_tokens": False}).json()
    assert eos["tokens"] == [server.engine.tokenizer.eos_token_id]
    detok = requests.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == "test"


def test_metrics_count_what_was_served(server):
    def sample(text: str, name: str) -> float:
        """The sum of a series' samples; `name{label="value"}` keeps those with that label."""
        base, _, label = name.partition("{")
        label = label.rstrip("}")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(base + "{") and label in line)

    before = requests.get(server.url + "/metrics").text
    for stream in (False, True):
        r = requests.post(server.url + "/v1/completions", json={
            "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "stream": stream})
        assert r.status_code == 200
    server.wait_idle()
    after = requests.get(server.url + "/metrics").text
    for name, added in (("vllm:prompt_tokens_total", 6), ("vllm:generation_tokens_total", 8),
                        ('vllm:request_success_total{finished_reason="length"}', 2),
                        ("vllm:time_to_first_token_seconds_count", 2),
                        ("vllm:e2e_request_latency_seconds_count", 2),
                        ("vllm:inter_token_latency_seconds_count", 6),
                        ("vllm:request_queue_time_seconds_count", 2),
                        ("vllm:request_prefill_time_seconds_count", 2),
                        ("vllm:request_decode_time_seconds_count", 2),
                        ("vllm:request_inference_time_seconds_count", 2),
                        ("vllm:request_params_max_tokens_sum", 8)):
        assert sample(after, name) - sample(before, name) == added, name
    r = requests.post(server.url + "/v1/completions", json={
        "prompt": [[5, 6], [7]], "max_tokens": 3, "ignore_eos": True, "n": 2})
    assert r.status_code == 200
    server.wait_idle()
    last = requests.get(server.url + "/metrics").text
    for name, added in (("vllm:request_params_n_count", 2), ("vllm:request_params_n_sum", 4),
                        ("vllm:request_max_num_generation_tokens_count", 2),
                        ("vllm:request_max_num_generation_tokens_sum", 6)):
        assert sample(last, name) - sample(after, name) == added, name
    info = [line for line in last.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and info[0].endswith(" 1.0") and 'block_size="' in info[0] \
        and 'num_gpu_blocks="' in info[0], info
    # the phases add up: queue + prefill = TTFT; queue + inference <= end to end
    spent = {name: sample(after, f"vllm:{name}_sum") - sample(before, f"vllm:{name}_sum")
             for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                          "time_to_first_token_seconds", "request_inference_time_seconds",
                          "e2e_request_latency_seconds")}
    assert spent["request_queue_time_seconds"] + spent["request_prefill_time_seconds"] == \
        pytest.approx(spent["time_to_first_token_seconds"])
    assert (spent["request_queue_time_seconds"] + spent["request_inference_time_seconds"]
            <= spent["e2e_request_latency_seconds"] + 1e-6)
    for gauge in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert sample(after, gauge) == 0  # the core reports its stats when it goes idle


BAD_BODIES = [
    ("not json", "body"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5] * 5000}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
]
BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30}, "top_logprobs"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_bad_completion_input_is_a_400_naming_the_field(server, body, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = requests.post(server.url + "/v1/completions", data=data,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert param in (error["param"] or "") or param in error["message"]


@pytest.mark.parametrize("body,param", BAD_CHAT)
def test_bad_chat_input_is_a_400_naming_the_field(server, body, param):
    r = requests.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]


def test_engine_failure_fails_only_that_step(server):
    server.wait_idle()
    fail_next_step("simulated fault")
    r = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 500 and "simulated fault" in r.json()["error"]["message"]
    r = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 200
    stats = server.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)


def test_a_client_disconnect_aborts_its_request_in_the_core(server):
    server.wait_idle()
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with requests.post(server.url + "/v1/completions", json=body, stream=True) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: {")
        stats = server.core_stats()
        assert stats.num_running == 1 and stats.kv_usage > 0
    stats = server.wait_idle()  # the core dropped the request and freed its blocks
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)


def test_64_streams_with_a_quarter_disconnecting(server):
    async def one(session, i):
        body = {"prompt": f"stream {i}", "max_tokens": 24, "stream": True, "ignore_eos": True,
                "temperature": 0.7, "seed": i, "stream_options": {"include_usage": True}}
        async with session.post(server.url + "/v1/completions", json=body) as response:
            events = 0
            async for line in response.content:
                if line.startswith(b"data: ") and b"[DONE]" not in line:
                    events += 1
                    if i % 4 == 0 and events == 2:
                        return None  # disconnect mid-stream
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        return usage["completion_tokens"]
            return None

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(results[i] == 24 for i in range(64) if i % 4)
    stats = server.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)


def test_api_key_is_enforced():
    with RunningServer(api_key="sekret") as keyed:
        body = {"prompt": "x", "max_tokens": 1}
        assert requests.post(keyed.url + "/v1/completions", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert requests.post(keyed.url + "/v1/completions", json=body,
                             headers=wrong).status_code == 401
        good = {"Authorization": "Bearer sekret"}
        assert requests.post(keyed.url + "/v1/completions", json=body,
                             headers=good).status_code == 200
        streamed = requests.post(keyed.url + "/v1/completions", headers=good,
                                 json={**body, "max_tokens": 4, "stream": True})
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert streamed.status_code == 200 and events[-1] == "data: [DONE]"
        assert 2 <= len(events) <= 4 + 1  # an event per token (or merged deltas), then [DONE]
        assert requests.get(keyed.url + "/health").status_code == 200
