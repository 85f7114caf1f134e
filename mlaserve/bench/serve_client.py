"""HTTP side of the serving benchmark: request bodies, SSE stream parsing and per-request timing,
plus the auxiliary calls (/v1/models, /tokenize alignment, readiness probe, /metrics counters).

Everything matches vLLM 0.33's benchmark client so that the numbers compare 1:1:

- timing starts at ``perf_counter()`` just before the POST; every JSON message that is a token
  event sets TTFT (the first) or appends one inter-token gap (each later one), so ITL counts
  chunks, not tokens; latency ends at the last token event (usage and ``[DONE]`` don't count);
- the usage chunk (``choices`` empty) supplies ``completion_tokens`` and ``prompt_tokens``;
- a non-200 status fails with the HTTP reason; any exception fails with its traceback.
"""

import asyncio
import codecs
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from mlaserve.bench.serve_dataset import SampleRequest

SSE_DATA_PREFIX = "data: "
NO_TOKEN_ERROR = (
    "Never received a valid chunk to calculate TTFT.This response will be marked as failed!"
)


@dataclass
class RequestInput:
    """What one benchmark request sends."""

    prompt: str
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    model_name: str | None = None
    logprobs: int | None = None
    extra_headers: dict[str, str] | None = None
    extra_body: dict[str, Any] | None = None
    ignore_eos: bool = False
    request_id: str | None = None


@dataclass
class RequestOutput:
    """What one benchmark request measured. Times are seconds; start_time is perf_counter."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0
    client_queue_time: float = 0.0


class SSEBuffer:
    """Accumulates raw body bytes and yields complete SSE messages (split on a blank line).

    A trailing message without its blank line is released early when it is ``data: [DONE]`` or
    ``data: <valid JSON>``, since some servers flush the separator with the next event.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def add(self, data: bytes) -> list[str]:
        """Feed bytes; return the messages completed by them, stripped, empty ones dropped."""
        self._buffer += self._decoder.decode(data)
        messages = []
        while "\n\n" in self._buffer:
            message, self._buffer = self._buffer.split("\n\n", 1)
            if message := message.strip():
                messages.append(message)
        if self._buffer.startswith(SSE_DATA_PREFIX):
            content = self._buffer.removeprefix(SSE_DATA_PREFIX).strip()
            complete = content == "[DONE]"
            if content and not complete:
                with contextlib.suppress(json.JSONDecodeError):
                    json.loads(content)
                    complete = True
            if complete:
                messages.append(self._buffer.strip())
                self._buffer = ""
        return messages


def _headers(request: RequestInput, content_type: str | None = None) -> dict[str, str]:
    headers = {}
    if content_type:
        headers["Content-Type"] = content_type
    if api_key := os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {api_key}"
    if request.extra_headers:
        headers.update(request.extra_headers)
    if request.request_id:
        headers["x-request-id"] = request.request_id
    return headers


def _finish_payload(payload: dict[str, Any], request: RequestInput) -> dict[str, Any]:
    if request.ignore_eos:
        payload["ignore_eos"] = True
    if request.extra_body:
        payload.update(request.extra_body)
    return payload


def completions_payload(request: RequestInput) -> dict[str, Any]:
    """The /v1/completions body, in vLLM 0.33's key order."""
    payload = {
        "model": request.model_name or request.model,
        "prompt": request.prompt,
        "repetition_penalty": 1.0,
        "max_tokens": request.output_len,
        "logprobs": request.logprobs,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _finish_payload(payload, request)


def chat_payload(request: RequestInput) -> dict[str, Any]:
    """The /v1/chat/completions body: one user message whose content is a list of parts."""
    payload = {
        "model": request.model_name or request.model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": request.prompt}]}],
        "max_completion_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _finish_payload(payload, request)


def completions_token_text(choice: dict[str, Any]) -> str | None:
    """Every completions chunk with a choice is a token event, even with empty text."""
    return choice.get("text") or ""


def chat_token_text(choice: dict[str, Any]) -> str | None:
    """A chat chunk is a token event if its delta carries output; the opening role chunk
    (``{"role": "assistant", "content": ""}``) is not. None means "not a token event"."""
    delta = choice.get("delta") or {}
    content = delta.get("content")
    has_output = any(delta.get(k) for k in ("content", "reasoning", "tool_calls", "function_call"))
    if has_output or (content == "" and "role" not in delta):
        return content or ""
    return None


async def stream_request(
    request: RequestInput,
    session: aiohttp.ClientSession,
    payload: dict[str, Any],
    headers: dict[str, str],
    token_text: Callable[[dict[str, Any]], str | None],
) -> RequestOutput:
    """POST ``payload`` and time the SSE stream; never raises (failures land in ``error``)."""
    output = RequestOutput(prompt_len=request.prompt_len)
    generated_text = ""
    start = time.perf_counter()
    output.start_time = start
    last_event = start
    try:
        async with session.post(url=request.api_url, json=payload, headers=headers) as response:
            if response.status != 200:
                output.error = response.reason or ""
                return output
            got_token = False
            sse = SSEBuffer()
            async for raw in response.content.iter_any():
                # vLLM strips every network chunk before buffering; kept for identical parsing.
                raw = raw.strip()
                if not raw:
                    continue
                for message in sse.add(raw):
                    if message.startswith(":"):  # SSE comment / keep-alive
                        continue
                    data_text = message.removeprefix(SSE_DATA_PREFIX)
                    if data_text == "[DONE]":
                        continue
                    data = json.loads(data_text)
                    now = time.perf_counter()
                    if choices := data.get("choices"):
                        text = token_text(choices[0])
                        if text is None:
                            continue
                        if got_token:
                            output.itl.append(now - last_event)
                        else:
                            got_token = True
                            output.ttft = now - start
                        last_event = now
                        generated_text += text
                    elif usage := data.get("usage"):
                        output.output_tokens = usage.get("completion_tokens")
                        if (prompt_tokens := usage.get("prompt_tokens")) is not None:
                            output.prompt_len = prompt_tokens
            output.success = got_token
            if not got_token:
                output.error = NO_TOKEN_ERROR
            output.generated_text = generated_text
            output.latency = last_event - start
    except Exception:
        output.success = False
        output.error = "".join(traceback.format_exception(*sys.exc_info()))
    return output


async def request_completions(
    request: RequestInput, session: aiohttp.ClientSession
) -> RequestOutput:
    """One streamed /v1/completions request (backends ``openai`` and ``vllm``)."""
    return await stream_request(
        request, session, completions_payload(request), _headers(request), completions_token_text
    )


async def request_chat(request: RequestInput, session: aiohttp.ClientSession) -> RequestOutput:
    """One streamed /v1/chat/completions request (backend ``openai-chat``)."""
    headers = _headers(request, "application/json")
    return await stream_request(request, session, chat_payload(request), headers, chat_token_text)


RequestFunc = Callable[[RequestInput, aiohttp.ClientSession], Awaitable[RequestOutput]]

# backend -> (request function, required suffix of the API URL)
BACKENDS: dict[str, tuple[RequestFunc, str]] = {
    "openai": (request_completions, "completions"),
    "vllm": (request_completions, "completions"),
    "openai-chat": (request_chat, "chat/completions"),
}


async def fetch_first_model(
    base_url: str, headers: dict[str, str] | None = None
) -> tuple[str, str]:
    """GET /v1/models; return ``(data[0].id, data[0].root)``: the name to send and the model
    path the tokenizer is loaded from."""
    url = f"{base_url}/v1/models"
    try:
        async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
            resp.raise_for_status()
            data = await resp.json()
    except (aiohttp.ClientError, json.JSONDecodeError) as exc:
        raise RuntimeError(f"could not list the models at {url}: {exc}") from exc
    if not data.get("data"):
        raise RuntimeError(f"the server at {base_url} lists no models")
    return data["data"][0]["id"], data["data"][0]["root"]


async def align_prompts_to_server(
    base_url: str, model_id: str, requests: list[SampleRequest]
) -> list[SampleRequest]:
    """Check the first prompt's length with the server's /tokenize; if it differs, re-tokenize
    every prompt (64 at a time) and cut those the server sees as longer than prompt_len back to
    prompt_len tokens via /detokenize. Any failure of the first call skips the alignment."""
    if not requests:
        return requests
    semaphore = asyncio.Semaphore(64)
    async with aiohttp.ClientSession() as session:

        async def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            async with semaphore, session.post(f"{base_url}{path}", json=body) as resp:
                resp.raise_for_status()
                return await resp.json()

        async def tokenize(prompt: str) -> list[int]:
            body = {"model": model_id, "prompt": prompt, "add_special_tokens": False}
            return (await post("/tokenize", body))["tokens"]

        try:
            first_tokens = await tokenize(requests[0].prompt)
        except Exception:
            print("WARNING: /tokenize unavailable, skipping alignment.")
            return requests
        expected = requests[0].prompt_len
        if len(first_tokens) == expected:
            return requests
        print(
            f"WARNING: tokenizer mismatch (server={len(first_tokens)}, expected={expected}), "
            "re-aligning prompts."
        )

        async def fix(request: SampleRequest) -> SampleRequest:
            tokens = await tokenize(request.prompt)
            if len(tokens) <= request.prompt_len:
                return request
            body = {"model": model_id, "tokens": tokens[: request.prompt_len]}
            return replace(request, prompt=(await post("/detokenize", body))["prompt"])

        fixed = await asyncio.gather(*(fix(r) for r in requests), return_exceptions=True)
    pairs = zip(requests, fixed, strict=True)
    return [new if isinstance(new, SampleRequest) else old for old, new in pairs]


async def wait_for_endpoint(
    request_func: RequestFunc,
    request: RequestInput,
    session: aiohttp.ClientSession,
    timeout_s: float,
    retry_interval_s: float = 5.0,
) -> RequestOutput:
    """Send ``request`` until it succeeds, every ``retry_interval_s``, for up to ``timeout_s``."""
    print(f"Waiting for endpoint to become up in {timeout_s} seconds")
    deadline = time.perf_counter() + timeout_s
    output = RequestOutput()
    while (remaining := deadline - time.perf_counter()) > 0:
        try:
            output = await asyncio.wait_for(request_func(request, session), remaining)
        except TimeoutError:
            break
        if output.success:
            return output
        last_line = output.error.rstrip().rsplit("\n", 1)[-1]
        print(f"WARNING: Endpoint is not ready. Error='{last_line}'")
        await asyncio.sleep(max(0.0, min(retry_interval_s, deadline - time.perf_counter())))
    if not output.error:
        output.error = f"Endpoint readiness timed out after {timeout_s}s."
    return output


@dataclass
class SpecDecodeCounters:
    """Speculative-decoding counters read from the server's Prometheus /metrics."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: dict[int, int] = field(default_factory=dict)


async def fetch_spec_decode_counters(
    base_url: str, session: aiohttp.ClientSession
) -> SpecDecodeCounters | None:
    """Sum the ``vllm:spec_decode_*_total`` counters across labels; None when absent."""
    try:
        async with session.get(f"{base_url}/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (TimeoutError, aiohttp.ClientError):
        return None
    counters = SpecDecodeCounters()
    found = False
    for line in text.split("\n"):
        line = line.strip()
        if not line.startswith("vllm:spec_decode"):
            continue
        parts = line.split(None, 1)
        name = parts[0].split("{")[0]
        if not name.endswith("_total"):
            continue
        found = True
        with contextlib.suppress(ValueError):
            value = int(float(parts[-1].split()[-1]))
            if "num_drafts" in name:
                counters.num_drafts += value
            elif "num_draft_tokens" in name:
                counters.num_draft_tokens += value
            elif "num_accepted_tokens_per_pos" in name:
                label = 'position="'
                if label in line:
                    start = line.index(label) + len(label)
                    pos = int(line[start : line.index('"', start)])
                    counters.accepted_per_pos[pos] = counters.accepted_per_pos.get(pos, 0) + value
            elif "num_accepted_tokens" in name:
                counters.num_accepted_tokens += value
    return counters if found else None


def spec_decode_stats(
    before: SpecDecodeCounters | None, after: SpecDecodeCounters | None
) -> dict[str, Any] | None:
    """Acceptance statistics over the run from two counter snapshots; None without drafts."""
    if before is None or after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if draft_tokens <= 0:
        return None
    per_pos = []
    if drafts > 0:
        for pos in sorted(set(before.accepted_per_pos) | set(after.accepted_per_pos)):
            old = before.accepted_per_pos.get(pos, 0)
            per_pos.append((after.accepted_per_pos.get(pos, old) - old) / drafts)
    return {
        "acceptance_rate": accepted / draft_tokens * 100,
        "acceptance_length": 1 + accepted / drafts if drafts > 0 else 0.0,
        "num_drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "per_position_acceptance_rates": per_pos,
    }
