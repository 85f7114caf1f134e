"""Load against the real server on the demo model (CPU): 500 concurrent streams, a quarter of
them disconnecting early and a tenth hostile. Nothing is lost, no KV block leaks, no request
gets a 5xx, and every innocent stream finishes with the output it gets alone."""

import asyncio
import json

import aiohttp

from tests.server_util import RunningServer

NUM_STREAMS = 500
MAX_TOKENS = 8
PROMPTS = ["The latent cache holds", "Attention over pages", "One request never",
           "Continuous batching keeps"]
# One body per class of hostile input; each must be refused alone with a 4xx.
HOSTILE = [
    {"prompt": "x", "max_tokens": 4, "top_k": 9223372036854775808},
    {"prompt": "x", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [99999]},
    {"prompt": "x", "max_tokens": 4, "logit_bias": {"99999": 5}},
    {"prompt": "x", "max_tokens": 4, "temperature": float("nan")},
    {"prompt": [1, 2, -3], "max_tokens": 4},
    {"prompt": "x", "model": "no-such-model"},
    {"prompt": "x", "max_tokens": 10**9},
    {"prompt": "x", "max_tokens": 4, "presence_penalty": 1e308},
]


async def innocent(session: aiohttp.ClientSession, url: str, index: int) -> tuple[int, str]:
    body = {"prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, finish = [], None, None
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
            usage = chunk.get("usage") or usage
    assert finish == "length" and usage["completion_tokens"] == MAX_TOKENS
    return index, "".join(text)


async def disconnecting(session: aiohttp.ClientSession, url: str, index: int) -> None:
    body = {"prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": 64, "ignore_eos": True,
            "stream": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200
        await response.content.readline()  # the first event, then hang up
        response.close()


async def hostile(session: aiohttp.ClientSession, url: str, index: int) -> int:
    body = json.dumps(HOSTILE[index % len(HOSTILE)], allow_nan=True)
    async with session.post(url + "/v1/completions", data=body,
                            headers={"Content-Type": "application/json"}) as response:
        payload = await response.json()
        assert 400 <= response.status < 500, (HOSTILE[index % len(HOSTILE)], payload)
        assert payload["error"]["message"]
        return response.status


async def load(url: str) -> tuple[dict[int, str], list[int]]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        jobs = []
        for i in range(NUM_STREAMS):
            if i % 10 == 3:  # a tenth
                jobs.append(hostile(session, url, i // 10))
            elif i % 4 == 0:  # a quarter (never i % 10 == 3: odd)
                jobs.append(disconnecting(session, url, i))
            else:
                jobs.append(innocent(session, url, i))
        results = await asyncio.gather(*jobs)
        alone = {}
        for index in range(len(PROMPTS)):
            _, alone[index] = await innocent(session, url, index)
    outputs = dict(r for r in results if isinstance(r, tuple))
    statuses = [r for r in results if isinstance(r, int)]
    return {i: (text, alone[i % len(PROMPTS)]) for i, text in outputs.items()}, statuses


def test_500_streams_with_disconnects_and_hostile_requests():
    with RunningServer(max_model_len=256, num_kv_blocks=256, max_num_seqs=128) as server:
        outputs, statuses = asyncio.run(load(server.url))
        stats = server.wait_idle()
        assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)
        assert server.engine.num_in_flight == 0
    assert len(statuses) == NUM_STREAMS // 10  # every hostile request refused with a 4xx
    assert len(outputs) == NUM_STREAMS - NUM_STREAMS // 10 - NUM_STREAMS // 4  # 325 finished
    for text, alone in outputs.values():
        assert text == alone  # greedy: the same output in a crowd as alone
