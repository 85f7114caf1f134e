"""The /v1/completions and /v1/chat/completions handlers.

Streams ask the engine for delta outputs (each holds only the text, token ids and logprobs that
are new), so every SSE chunk is built from what is new, never by slicing what was sent before;
non-streaming requests ask for the final output only. Latency metrics are taken by the engine
client, which sees every token.
"""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse

from mlaserve.engine.core_client import AsyncEngineClient, EngineError
from mlaserve.engine.request import RequestOutput, SamplingParams
from mlaserve.server.formatting import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    error_body,
    sse,
    usage,
)
from mlaserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or {400: "BadRequestError", 401: "AuthenticationError",
                                     404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
            status, "InternalServerError")

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.err_type, self.status, self.param),
                            status_code=self.status)


@dataclass
class Prepared:
    """One prompt ready for the engine."""

    prompt_text: str
    token_ids: list[int]
    params: SamplingParams
    drop_generated: bool = False  # echo with max_tokens=0: return the prompt only


class Serving:
    """Shared by the handlers: the engine client, the names and the token-text cache."""

    def __init__(self, engine: AsyncEngineClient, served_model_name: str,
                 model_root: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.model_root = model_root
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.info.max_model_len
        self.token_text = TokenText(self.tokenizer)

    # ---- shared steps -------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.served_model_name, self.model_root):
            raise APIError(400, f"The model `{model}` does not exist; this server serves "
                           f"`{self.served_model_name}`.", param="model")

    def fit_max_tokens(self, num_prompt: int, requested: int | None) -> int:
        """vLLM's rule: a prompt over max_model_len is an error; max_tokens is clamped to fit."""
        room = self.max_model_len - num_prompt
        if room <= 0:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, your request has {num_prompt} input tokens. "
                           "Please reduce the length of the input.", param="prompt")
        return room if requested is None else min(requested, room)

    async def start(self, prepared: list[Prepared]) -> list[AsyncIterator[RequestOutput]]:
        streams = []
        base = f"cmpl-{uuid.uuid4().hex}"
        try:
            for i, p in enumerate(prepared):
                streams.append(await self.engine.add_request(p.token_ids, p.params,
                                                             f"{base}-{i}"))
        except (ValueError, EngineError) as exc:
            for i in range(len(streams)):
                self.engine.abort(f"{base}-{i}")
            if isinstance(exc, EngineError):
                raise APIError(503, f"engine failure: {exc}") from None
            raise APIError(400, str(exc)) from None
        return streams

    @staticmethod
    async def collect(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        """The last output of a stream (the only one, for output_kind="final_only")."""
        async for output in stream:
            last = output
        return last

    # ---- completions --------------------------------------------------------------------
    def prepare_completion(self, req: CompletionRequest) -> list[Prepared]:
        self.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, str):
            items = [prompt]
        elif all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        prepared = []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenizer(item, add_special_tokens=req.add_special_tokens)["input_ids"]
                text = item
            else:
                vocab = self.engine.info.vocab_size
                bad = [t for t in item if not 0 <= t < vocab]
                if bad:
                    raise APIError(400, f"prompt token ids must lie in [0, {vocab}); got "
                                   f"{bad[:5]}", param="prompt")
                ids, text = list(item), self.tokenizer.decode(item)
            if not ids:
                raise APIError(400, "the prompt is empty", param="prompt")
            echo_only = req.echo and req.max_tokens == 0
            if req.max_tokens == 0 and not req.echo:
                raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
            max_tokens = 1 if echo_only else self.fit_max_tokens(len(ids), req.max_tokens)
            prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
            try:
                params = req.sampling_params(max_tokens, req.logprobs, prompt_logprobs,
                                             output_kind(req.stream))
            except ValueError as exc:
                raise APIError(400, str(exc)) from None
            prepared.append(Prepared(text, ids, params, echo_only))
        return prepared

    def completion_choice(self, index: int, p: Prepared, out: RequestOutput,
                          echo: bool, want_logprobs: bool) -> dict:
        token_ids = [] if p.drop_generated else out.token_ids
        text = "" if p.drop_generated else out.text
        logprobs = None
        if want_logprobs:
            entries = [] if p.drop_generated else out.logprobs[: len(token_ids)]
            if echo:
                logprobs = completion_logprobs(p.token_ids + token_ids,
                                               out.prompt_logprobs + entries, self.token_text)
            else:
                logprobs = completion_logprobs(token_ids, entries, self.token_text)
        return {"index": index, "text": (p.prompt_text if echo else "") + text,
                "logprobs": logprobs,
                "finish_reason": "length" if p.drop_generated else out.finish_reason,
                "stop_reason": None if p.drop_generated else out.stop_reason}

    async def completions(self, req: CompletionRequest):
        prepared = self.prepare_completion(req)
        streams = await self.start(prepared)
        created = int(time.time())
        response_id = f"cmpl-{uuid.uuid4().hex}"
        model = req.model or self.served_model_name
        want_logprobs = req.logprobs is not None
        if req.stream:
            return StreamingResponse(self._stream_completions(
                req, prepared, streams, response_id, created, model, want_logprobs),
                media_type="text/event-stream")
        try:
            outputs = await asyncio.gather(*(self.collect(s) for s in streams))
        except EngineError as exc:
            raise APIError(500, f"engine failure: {exc}") from None
        choices = [self.completion_choice(i, p, o, req.echo, want_logprobs)
                   for i, (p, o) in enumerate(zip(prepared, outputs, strict=True))]
        n_prompt = sum(len(p.token_ids) for p in prepared)
        n_out = sum(0 if p.drop_generated else len(o.token_ids)
                    for p, o in zip(prepared, outputs, strict=True))
        return {"id": response_id, "object": "text_completion", "created": created,
                "model": model, "choices": choices, "usage": usage(n_prompt, n_out)}

    async def _stream_completions(self, req, prepared, streams, response_id, created, model,
                                  want_logprobs):
        head = {"id": response_id, "object": "text_completion", "created": created,
                "model": model}
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats
        n_prompt = sum(len(p.token_ids) for p in prepared)
        sent_tokens = [0] * len(prepared)
        num_generated = 0
        try:
            async for index, out in merge(streams):  # delta outputs
                p = prepared[index]
                first = sent_tokens[index] == 0
                delta = out.text
                logprobs = None
                if want_logprobs:
                    if req.echo and first:
                        logprobs = completion_logprobs(p.token_ids + out.token_ids,
                                                       out.prompt_logprobs + out.logprobs,
                                                       self.token_text)
                    else:
                        logprobs = completion_logprobs(out.token_ids, out.logprobs,
                                                       self.token_text)
                if req.echo and first:
                    delta = p.prompt_text + delta
                if p.drop_generated:
                    delta = p.prompt_text
                sent_tokens[index] += len(out.token_ids)
                num_generated += len(out.token_ids)
                chunk = {**head, "choices": [{
                    "index": index, "text": delta, "logprobs": logprobs,
                    "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}]}
                if continuous:
                    chunk["usage"] = usage(n_prompt, num_generated)
                yield sse(chunk)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(n_prompt, num_generated)})
        except EngineError as exc:
            yield sse(error_body(f"engine failure: {exc}", "InternalServerError", 500))
        yield sse("[DONE]")

    # ---- chat ---------------------------------------------------------------------------
    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool,
                        template_kwargs: dict | None) -> list[int]:
        """Render the chat template (which carries BOS) and tokenize without special tokens."""
        if not messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        plain = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                plain, add_generation_prompt=add_generation_prompt, tokenize=False,
                **(template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise APIError(400, f"the chat template cannot render these messages: {exc}",
                           param="messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self.check_model(req.model)
        ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt,
                                   req.chat_template_kwargs)
        text = self.tokenizer.decode(ids)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if requested == 0:
            raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
        max_tokens = self.fit_max_tokens(len(ids), requested)
        k = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = req.sampling_params(max_tokens, k, None, output_kind(req.stream))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return Prepared(text, ids, params)

    async def chat(self, req: ChatCompletionRequest):
        prepared = self.prepare_chat(req)
        (stream,) = await self.start([prepared])
        created = int(time.time())
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        model = req.model or self.served_model_name
        if req.stream:
            return StreamingResponse(self._stream_chat(req, prepared, stream, response_id,
                                                       created, model),
                                     media_type="text/event-stream")
        try:
            out = await self.collect(stream)
        except EngineError as exc:
            raise APIError(500, f"engine failure: {exc}") from None
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(out.token_ids, out.logprobs, req.top_logprobs or 0,
                                     self.token_text)
        return {"id": response_id, "object": "chat.completion", "created": created,
                "model": model, "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": out.text,
                                            "reasoning": None},
                    "logprobs": logprobs, "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason}],
                "usage": usage(len(prepared.token_ids), len(out.token_ids))}

    async def _stream_chat(self, req, prepared, stream, response_id, created, model):
        head = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                "model": model}
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        n_prompt = len(prepared.token_ids)
        yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]})
        num_generated = 0
        try:
            async for out in stream:  # delta outputs
                logprobs = None
                if req.logprobs:
                    logprobs = chat_logprobs(out.token_ids, out.logprobs, req.top_logprobs or 0,
                                             self.token_text)
                num_generated += len(out.token_ids)
                yield sse({**head, "choices": [{"index": 0, "delta": {"content": out.text},
                                                "logprobs": logprobs,
                                                "finish_reason": out.finish_reason}]})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(n_prompt, num_generated)})
        except EngineError as exc:
            yield sse(error_body(f"engine failure: {exc}", "InternalServerError", 500))
        yield sse("[DONE]")


def output_kind(stream: bool) -> str:
    """Streams take each step's delta; a whole response needs only the final output."""
    return "delta" if stream else "final_only"


async def merge(streams: list[AsyncIterator[RequestOutput]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (index, output) in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
