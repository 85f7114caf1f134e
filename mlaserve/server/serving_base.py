"""What the request handlers share: OpenAI-style errors, the API process's limits, admission,
and the engine requests of an HTTP request and their streams (`ServingBase`, on which
serving_templates.py and serving.py build `Serving`).

Streams ask the engine for delta outputs (each holds only the text, token ids and logprobs that
are new), so every SSE chunk is built from what is new, never by slicing what was sent before;
non-streaming requests ask for the final output only. Latency metrics are taken by the engine
client, which sees every token.

What a request may cost is bounded before the engine sees it: text longer than
`MAX_CHARS_PER_TOKEN` characters per token of the context is refused before it is tokenized;
tokenizing and chat-template rendering run in a small thread pool (the event loop keeps serving
/health and the other streams meanwhile; a request's own template renders in a worker process,
chat_template_sandbox.py); at most max_num_seqs + max_waiting_requests prompts are admitted at
once (the next gets 503 with Retry-After), of which one request (prompts x samples) may hold at
most `max_request_share` (more is a 400). A constrained request is answered once its grammar
has compiled (`start`), so a constraint the engine refuses is a 400 even when streaming. A
stream whose client stops reading for `stream_send_timeout_s` is aborted; a non-streaming
request whose client disconnects is aborted (one INFO line); on shutdown the requests still in
flight are aborted in time for an error event.
"""

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from msgspec.structs import replace

from mlaserve.engine.core_client import AsyncEngineClient, EngineError, RequestRejected
from mlaserve.engine.request import RequestOutput, SamplingParams, StructuredOutputs
from mlaserve.server.formatting import TokenText, error_body, sse, usage
from mlaserve.server.metrics import RequestGroup, ServerMetrics
from mlaserve.server.protocol import ResponseModel, SamplingFields
from mlaserve.server.protocol_stream import StreamChunk
from mlaserve.server.structured import StructuredOutputError, request_constraint

logger = logging.getLogger(__name__)

# Text longer than this many characters per token of max_model_len is refused before it is
# tokenized: no tokenizer of a served model packs that much text into a token on average, so such
# a prompt could never fit the context, and tokenizing it would only burn time and memory.
MAX_CHARS_PER_TOKEN = 32

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               413: "RequestEntityTooLargeError", 422: "UnprocessableEntityError",
               429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        # an error message never carries text that cannot be encoded (a lone surrogate)
        self.message = message.encode("utf-8", "backslashreplace").decode()
        self.param = param
        self.err_type = err_type or ERROR_TYPES.get(status, "InternalServerError")
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.err_type, self.status, self.param),
                            status_code=self.status, headers=self.headers)


@dataclass(frozen=True)
class ServingOptions:
    """The API process's limits (`mlaserve serve` flags)."""

    max_num_seqs: int = 256
    max_waiting_requests: int = 1024  # admitted prompts beyond max_num_seqs; then 503
    max_request_share: float = 0.5  # of those admitted at once, what one request may hold
    chat_template: str | None = None  # the server's template, in place of the tokenizer's
    # what a request's missing sampling fields take (`engine.generation_config`)
    default_sampling: Mapping[str, float | int] = field(default_factory=dict)
    trust_request_chat_template: bool = False
    chat_template_timeout_s: float = 2.0
    stream_send_timeout_s: float = 60.0  # a stream whose client reads nothing this long ends
    tokenizer_threads: int = 4
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # e.g. "deepseek_v3" (tool_calls.TOOL_CALL_PARSERS)
    reasoning_parser: str | None = None  # e.g. "deepseek_r1" (reasoning.REASONING_PARSERS)

    def __post_init__(self) -> None:
        if not 0 < self.max_request_share <= 1:
            raise ValueError("max_request_share must be in (0, 1] (a share of the requests "
                             f"admitted at once), got {self.max_request_share}")
        for name in ("chat_template_timeout_s", "stream_send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


@dataclass
class Prepared:
    """One sample of one prompt, ready for the engine."""

    prompt_text: str
    token_ids: list[int]
    params: SamplingParams
    drop_generated: bool = False  # echo with max_tokens=0: return the prompt only
    prompt_index: int = 0  # which prompt of the request (n samples share one)


@dataclass(eq=False)
class Admission:
    """Prompts admitted for one HTTP request; released once its answer is complete."""

    serving: "ServingBase"
    count: int
    request_ids: list[str] = field(default_factory=list)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.serving.num_admitted -= self.count
            self.serving.admissions.discard(self)


class EventStreamResponse(StreamingResponse):
    """An SSE response that ends (aborting its engine requests) when the client has read nothing
    for `send_timeout` seconds, and releases its admission however it ends."""

    def __init__(self, content: AsyncIterator[bytes], admission: Admission,
                 send_timeout: float) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.admission = admission
        self.send_timeout = send_timeout

    async def stream_response(self, send: Callable) -> None:
        async def bounded_send(message: dict) -> None:
            with anyio.fail_after(self.send_timeout):
                await send(message)

        try:
            await super().stream_response(bounded_send)
        except TimeoutError:
            logger.warning("a stream's client read nothing for %.0f s; ending the stream",
                           self.send_timeout)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.release()
            with suppress(Exception):
                await self.body_iterator.aclose()  # its finally aborts the engine requests


class ServingBase:
    """Shared by the handlers: the engine client, the names, the limits and the token-text
    cache."""

    def __init__(self, engine: AsyncEngineClient, served_model_names: Sequence[str],
                 model_root: str, options: ServingOptions | None = None) -> None:
        self.engine = engine
        self.served_model_names = tuple(served_model_names)  # any may be a request's model
        self.served_model_name = self.served_model_names[0]  # the one responses name
        self.model_root = model_root
        self.options = options or ServingOptions()
        self.tokenizer = engine.tokenizer
        if self.options.chat_template is not None:
            self.tokenizer.chat_template = self.options.chat_template
        self.max_model_len = engine.info.max_model_len
        self.max_prompt_chars = MAX_CHARS_PER_TOKEN * self.max_model_len
        self.token_text = TokenText(self.tokenizer)
        self.limiter = anyio.CapacityLimiter(self.options.tokenizer_threads)
        self.max_admitted = self.options.max_num_seqs + self.options.max_waiting_requests
        # one request's share of that bound (prompts x samples): no request locks the others out
        self.max_per_request = max(1, int(self.options.max_request_share * self.max_admitted))
        self.num_admitted = 0
        self.admissions: set[Admission] = set()
        self.metrics: ServerMetrics | None = None  # request groups for /metrics, when served
        self.draining = False  # the server is stopping: no new requests
        self.shutting_down = False  # and the requests in flight were aborted

    # ---- shared steps -------------------------------------------------------------------
    def admit(self, count: int) -> Admission:
        """Admit `count` prompts, or answer 503 (with Retry-After) when the queue is full."""
        if self.draining or self.shutting_down:
            raise APIError(503, "the server is shutting down")
        if self.num_admitted and self.num_admitted + count > self.max_admitted:
            raise APIError(503, f"the server is at capacity ({self.num_admitted} requests "
                           "running or waiting); retry later", headers={"Retry-After": "1"})
        self.num_admitted += count
        admission = Admission(self, count)
        self.admissions.add(admission)
        return admission

    def begin_shutdown(self) -> None:
        """Abort every request in flight (their streams end with an error event) and refuse
        new ones."""
        self.draining = self.shutting_down = True
        for admission in list(self.admissions):
            for request_id in admission.request_ids:
                self.engine.abort(request_id)

    async def in_thread(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run tokenizer or template work in the worker pool, off the event loop."""
        return await anyio.to_thread.run_sync(func, *args, limiter=self.limiter)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (*self.served_model_names, self.model_root):
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    def check_text(self, length: int, param: str) -> None:
        """Refuse text that could never fit the context, before tokenizing it."""
        if length > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, your request has {length} characters of text "
                           f"(more than {self.max_prompt_chars}, {MAX_CHARS_PER_TOKEN} per "
                           "token of the context). Please reduce the length of the input.",
                           param=param)

    def fit_max_tokens(self, num_prompt: int, requested: int | None) -> int:
        """vLLM's rule: a prompt over max_model_len is an error, and so is a max_tokens that
        does not fit beside the prompt; no max_tokens means all the room left, or the
        generation config's max_tokens if that is less."""
        room = self.max_model_len - num_prompt
        if room <= 0:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, your request has {num_prompt} input tokens. "
                           "Please reduce the length of the input messages.", param="prompt")
        if requested is not None and requested > room:
            raise APIError(400, "'max_tokens' or 'max_completion_tokens' is too large: "
                           f"{requested}. This model's maximum context length is "
                           f"{self.max_model_len} tokens and your request has {num_prompt} "
                           f"input tokens ({requested} > {self.max_model_len} - {num_prompt}).",
                           param="max_tokens")
        if requested is None:
            return min(room, self.options.default_sampling.get("max_tokens", room))
        return requested

    async def start(self, prepared: list[Prepared], admission: Admission,
                    raw_request: Request | None = None) -> list[AsyncIterator[RequestOutput]]:
        """Send the prepared requests to the engine; their output streams.

        Constrained requests are answered only once their grammar has compiled (their first
        output is awaited here), so a constraint the engine refuses is a 400 before any
        response starts, and a client that leaves meanwhile cancels the compile.
        """
        streams = []
        base = f"cmpl-{uuid.uuid4().hex}"
        try:
            for i, p in enumerate(prepared):
                streams.append(await self.engine.add_request(p.token_ids, p.params,
                                                             f"{base}-{i}"))
                admission.request_ids.append(f"{base}-{i}")
        except (ValueError, EngineError) as exc:
            for i in range(len(streams)):
                self.engine.abort(f"{base}-{i}")
            if isinstance(exc, EngineError):
                raise APIError(503, f"engine failure: {exc}") from None
            raise APIError(400, str(exc)) from None
        if self.metrics is not None:
            streams = self._grouped(prepared, streams)
        if any(p.params.structured_outputs is not None for p in prepared):
            streams = await self._after_first_output(streams, raw_request)
        return streams

    def _grouped(self, prepared: list[Prepared], streams: list[AsyncIterator[RequestOutput]]
                 ) -> list[AsyncIterator[RequestOutput]]:
        """Each prompt's samples as one request group of the metrics."""
        sizes = Counter(p.prompt_index for p in prepared)
        groups = {index: self.metrics.request_group(n) for index, n in sizes.items()}
        return [_counted(stream, groups[p.prompt_index])
                for p, stream in zip(prepared, streams, strict=True)]

    async def _after_first_output(self, streams: list[AsyncIterator[RequestOutput]],
                                  raw_request: Request | None
                                  ) -> list[AsyncIterator[RequestOutput]]:
        """Wait for each stream's first output (400 if the engine refused the request); the
        streams again, each from its first output on."""
        tasks = [asyncio.ensure_future(anext(stream)) for stream in streams]
        try:
            outputs = await self._unless_disconnected(asyncio.gather(*tasks), raw_request)
        except BaseException as exc:
            for task in tasks:  # a task cancelled in its stream aborts the engine request
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                with suppress(Exception):
                    await stream.aclose()
            if isinstance(exc, RequestRejected):
                raise APIError(400, str(exc)) from None
            if isinstance(exc, EngineError):
                raise APIError(500, f"engine failure: {exc}") from None
            raise
        return [_from(first, stream) for first, stream in zip(outputs, streams, strict=True)]

    @staticmethod
    async def _unless_disconnected(work: asyncio.Future, raw_request: Request | None) -> Any:
        """The result of `work`; if the client disconnects first, `work` is cancelled and the
        request ends with one INFO line (the 400 that answers it reaches no one)."""
        watcher = asyncio.ensure_future(wait_for_disconnect(raw_request))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                with suppress(asyncio.CancelledError, EngineError):
                    await work
        if work not in done:
            logger.info("a client disconnected before its answer; its request was aborted")
            raise APIError(400, "Client disconnected")
        return work.result()

    @staticmethod
    async def collect(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        """The last output of a stream (the only one, for output_kind="final_only")."""
        async for output in stream:
            last = output
        return last

    async def collect_all(self, streams: list[AsyncIterator[RequestOutput]],
                          raw_request: Request | None) -> list[RequestOutput]:
        """The final outputs; the requests are aborted if the client disconnects first."""
        gathered = asyncio.ensure_future(asyncio.gather(*(self.collect(s) for s in streams)))
        try:
            outputs = await self._unless_disconnected(gathered, raw_request)
        except RequestRejected as exc:
            raise APIError(400, str(exc)) from None
        except EngineError as exc:
            raise APIError(500, f"engine failure: {exc}") from None
        if self.shutting_down and any(o.finish_reason == "abort" for o in outputs):
            raise APIError(503, "the server is shutting down")
        return outputs

    def shutdown_event(self, finish_reason: str | None) -> bytes | None:
        """The error event that ends a stream cut short by a shutdown."""
        if self.shutting_down and finish_reason == "abort":
            return sse(error_body("the server is shutting down; the request was aborted",
                                  "ServiceUnavailableError", 503))
        return None

    def stream_end(self, head: StreamChunk, finish_reason: str | None, include_usage: bool,
                   n_prompt: int, num_generated: int) -> bytes | None:
        """The event after a stream's last chunk: the shutdown error of a stream cut short, else
        the usage chunk when asked for, else nothing (`[DONE]` follows either way)."""
        cut = self.shutdown_event(finish_reason)
        if cut is not None:
            return cut
        if include_usage:
            return sse(replace(head, usage=usage(n_prompt, num_generated)))
        return None

    # ---- sampling (completions and chat) ------------------------------------------------
    def check_samples(self, num_prompts: int, n: int, best_of: int | None = None,
                      stream: bool = False) -> int:
        """The number of samples per prompt (best_of, else n); 400 for what cannot be served."""
        samples = n if best_of is None else best_of
        if samples < n:
            raise APIError(400, f"best_of ({best_of}) must be at least n ({n})",
                           param="best_of")
        if stream and samples != n:
            raise APIError(400, "best_of must equal n when streaming", param="best_of")
        if num_prompts * samples > self.max_per_request:
            raise APIError(400, f"{num_prompts} prompts x {samples} samples are more than one "
                           f"request may hold ({self.max_per_request}: --max-request-share "
                           f"{self.options.max_request_share:g} of the {self.max_admitted} "
                           "sequences this server admits at once, --max-num-seqs + "
                           "--max-waiting-requests)", param="n" if samples > 1 else "prompt")
        return samples

    @staticmethod
    def check_prompt_logprobs(req: SamplingFields) -> None:
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.",
                           param="prompt_logprobs")

    @staticmethod
    def constraint(req: SamplingFields, tool_schema: dict | None = None
                   ) -> StructuredOutputs | None:
        try:
            return request_constraint(req, tool_schema)
        except StructuredOutputError as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    @staticmethod
    def truncate(ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last `keep` tokens."""
        return ids if keep is None or len(ids) <= keep else ids[-keep:]

    def sample_params(self, req: SamplingFields, samples: int, max_tokens: int,
                      logprobs: int | None, prompt_logprobs: int | None,
                      constraint: StructuredOutputs | None) -> list[SamplingParams]:
        """One SamplingParams per sample; sample i of a seeded request has seed + i."""
        try:
            return [req.sampling_params(max_tokens, logprobs, prompt_logprobs,
                                        output_kind(req.stream), constraint, seed_offset=i,
                                        defaults=self.options.default_sampling)
                    for i in range(samples)]
        except ValueError as exc:
            raise APIError(400, str(exc)) from None


def json_response(body: ResponseModel) -> Response:
    """A JSON response serialized by pydantic-core."""
    return Response(body.model_dump_json(), media_type="application/json")


async def wait_for_disconnect(raw_request: Request | None) -> None:
    """Return once the client of `raw_request` has disconnected (never, without a request)."""
    if raw_request is None:
        await asyncio.Event().wait()
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def _counted(stream: AsyncIterator[RequestOutput], group: RequestGroup
                  ) -> AsyncIterator[RequestOutput]:
    """`stream`, telling `group` how many tokens it generated once it ends (however it ends)."""
    tokens = 0
    try:
        async for output in stream:
            tokens = tokens + len(output.token_ids) if output.output_kind == "delta" \
                else len(output.token_ids)
            yield output
    finally:
        group.sample_ended(tokens)
        await stream.aclose()


async def _from(first: RequestOutput, stream: AsyncIterator[RequestOutput]
                ) -> AsyncIterator[RequestOutput]:
    """`first`, then the rest of `stream` (closed with this iterator)."""
    try:
        yield first
        if not first.finished:
            async for output in stream:
                yield output
    finally:
        await stream.aclose()


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


def prompt_token_count(prepared: list[Prepared]) -> int:
    """The prompt tokens of a request: each prompt counted once, however many samples."""
    seen: dict[int, int] = {}
    for p in prepared:
        seen.setdefault(p.prompt_index, len(p.token_ids))
    return sum(seen.values())
