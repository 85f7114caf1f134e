"""The FastAPI app: OpenAI routes, tokenizer routes, health, metrics, auth and error bodies.

The app runs in the API process; the model runs in an engine-core process that the app starts
when it starts (see engine/core_client.py). /health answers 503 until the model is loaded and
warmed up, and again once the engine is gone. A model that fails to load, or an engine process
that dies, stops the HTTP server (`ServerState.stop`; `build_server` wires it to uvicorn) after
the requests in flight have been answered with the error.

Every error is an OpenAI error object with its HTTP status (400 invalid input, 401 API key,
404 unknown model or route, 405 method, 408 body too slow, 413 body too large, 503 loading,
full or stopping); http_guards.py bounds a request's key, body and headers before a handler
runs. When the server stops, the requests still in flight shortly before the graceful-shutdown
deadline are aborted, so each stream ends with an error event and `[DONE]`.
"""

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field, fields
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlaserve import __version__
from mlaserve.engine.args import DEMO_MODEL_DIR, EngineArgs
from mlaserve.engine.core_client import AsyncEngineClient, EngineDeadError
from mlaserve.engine.generation_config import default_sampling
from mlaserve.engine.messages import SchedulerStats
from mlaserve.server.http_guards import (
    APIKeyMiddleware,
    RequestBodyMiddleware,
    error_response,
    header_timeout_protocol,
)
from mlaserve.server.metrics import ServerMetrics
from mlaserve.server.protocol import ErrorResponse
from mlaserve.server.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from mlaserve.server.protocol_completions import CompletionRequest, CompletionResponse
from mlaserve.server.protocol_extras import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
)
from mlaserve.server.protocol_responses import ResponsesRequest, ResponsesResponse
from mlaserve.server.reasoning import get_reasoning_parser
from mlaserve.server.serving import Serving
from mlaserve.server.serving_base import APIError, ServingOptions
from mlaserve.server.serving_chat import ChatServing
from mlaserve.server.serving_responses import ResponsesServing
from mlaserve.server.tool_calls import get_tool_call_parser

logger = logging.getLogger(__name__)

# The request body limit by default: room for a prompt of MAX_CHARS_PER_TOKEN (32) characters
# per token of the context, each written as a 6-byte JSON escape, plus 4 MiB for the rest.
BODY_BYTES_PER_TOKEN = 192
BODY_BYTES_BASE = 4 * 2**20
# Requests still in flight this long before the graceful-shutdown deadline are aborted (at most
# a quarter of the grace period), leaving time to send each its error event.
SHUTDOWN_ABORT_MARGIN_S = 2.0


def _terminate_this_process() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass(frozen=True)
class ServerOptions(ServingOptions):
    """The API server's options (`mlaserve serve` flags beyond the engine's)."""

    max_request_body_size: int | None = None  # bytes; None: 4 MiB + 192 B per context token
    header_read_timeout_s: float = 30.0  # a request's headers, from connection or last answer
    body_read_timeout_s: float = 60.0  # a request's whole body, from its first read
    stats_interval_s: float | None = 10.0  # the stats line's period while busy; None: none

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("header_read_timeout_s", "body_read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


@dataclass
class ServerState:
    engine_args: EngineArgs
    served_model_names: tuple[str, ...]  # the first names responses and metrics
    api_key: str | None = None
    options: ServerOptions = field(default_factory=ServerOptions)
    engine: AsyncEngineClient | None = None
    serving: Serving | None = None
    chat: ChatServing | None = None
    responses: ResponsesServing | None = None
    load_error: BaseException | None = None
    engine_error: EngineDeadError | None = None
    metrics: ServerMetrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    url: str | None = None  # where the server listens (set by build_server)
    # stops the HTTP server; SIGTERM suits a server run on the main thread by any runner
    stop: Callable[[], None] = _terminate_this_process

    @property
    def max_request_body_size(self) -> int:
        if self.options.max_request_body_size is not None:
            return self.options.max_request_body_size
        max_model_len = self.serving.max_model_len if self.serving is not None else 0
        return BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * max_model_len

    def begin_drain(self, grace_s: float | None) -> None:
        """The server stops accepting requests: refuse new ones now, and abort those in flight
        in time for their error events to go out before the grace period ends."""
        serving = self.serving
        if serving is None:
            return
        serving.draining = True
        if grace_s is not None:
            delay = max(0.0, grace_s - min(SHUTDOWN_ABORT_MARGIN_S, grace_s / 4))
            asyncio.get_running_loop().call_later(delay, serving.begin_shutdown)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") in ("invalid_text", "unsupported"):  # protocol's own checks
        return first["msg"], first["ctx"]["param"]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # union members add their type names to the location; keep the field path
    param = ".".join(p for p in loc if not p[:1].isupper() and "[" not in p) or None
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('ctx', {}).get('error') or first.get('msg')}", \
            "body"
    if not loc:
        return "the request body must be a JSON object (Content-Type: application/json)", "body"
    return f"{param or 'body'}: {first.get('msg')}", param


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries of the error codes a route can answer."""
    text = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
            408: "request body too slow", 413: "request body too large", 500: "engine failure",
            503: "model loading, server at capacity or stopping"}
    return {code: {"model": ErrorResponse, "description": text[code]} for code in codes}


def _openapi_without_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The schema as the server behaves: FastAPI's default 422 is answered as a 400 here."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def _public_tokenizer_value(key: str, value: Any) -> bool:
    """Tokenizer settings that are fit to publish: no file system paths."""
    if key in ("name_or_path", "vocab_file", "merges_file", "tokenizer_file"):
        return False
    return not (isinstance(value, str) and os.path.isabs(value))


def create_app(engine_args: EngineArgs, served_model_name: str | Sequence[str] | None = None,
               api_key: str | None = None, options: ServerOptions | None = None) -> FastAPI:
    """Build the app; the model loads in the background after startup (/health says 503).

    served_model_name: the name(s) requests may give as `model` (as vLLM's
    `--served-model-name A B`: any is accepted, the first names responses and metrics);
    default: the model directory as given.

    ValueError for options that cannot work (an unknown tool-call or reasoning parser, auto tool
    choice without a tool-call parser).
    """
    check_parser_options(options or ServerOptions())
    # the model directory as given to `serve` (clients load the tokenizer from it)
    model_root = engine_args.model or str(DEMO_MODEL_DIR)
    if isinstance(served_model_name, str):
        served_model_name = [served_model_name]
    names = tuple(served_model_name or [engine_args.model or "mlaserve-demo"])
    state = ServerState(engine_args, names, api_key, options or ServerOptions())
    state.metrics = ServerMetrics(names[0])
    serving_options = ServingOptions(**{
        **{f.name: getattr(state.options, f.name) for f in fields(ServingOptions)},
        "max_num_seqs": engine_args.max_num_seqs,
        "default_sampling": default_sampling(engine_args)})

    def on_engine_dead(error: EngineDeadError) -> None:
        logger.error("%s; stopping the server", error)
        state.engine_error = error
        state.stop()

    async def load() -> None:
        try:
            engine = await AsyncEngineClient.start(engine_args, state.metrics, on_engine_dead)
        except Exception as exc:  # noqa: BLE001 - reported, then the server stops
            logger.error("model failed to load: %s", exc)
            state.load_error = exc
            state.stop()
            return
        serving = Serving(engine, names, model_root, serving_options)
        state.chat = ChatServing(serving)
        state.responses = ResponsesServing(state.chat)
        # start-up's objects (torch, transformers, the tokenizer) live as long as the process:
        # out of the collector's reach, a full collection no longer walks them (it blocked the
        # event loop for ~250 ms)
        gc.collect()
        gc.freeze()
        state.serving = serving
        state.engine = engine
        logger.info("serving on %s (model %s)", state.url or "the configured address",
                    ", ".join(names))

    async def log_stats() -> None:
        """vLLM's stats line every stats_interval_s; at debug level once two intervals in a row
        had no tokens (ServerMetrics.interval_was_idle)."""
        while True:
            await asyncio.sleep(state.options.stats_interval_s)
            stats_line = getattr(state.metrics, "stats_line", None)
            if state.engine is None or stats_line is None:
                continue
            line = stats_line(state.engine.scheduler_stats)
            idle = getattr(state.metrics, "interval_was_idle", False)
            logger.log(logging.DEBUG if idle else logging.INFO, "%s", line)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(load())
        stats = asyncio.create_task(log_stats()) if state.options.stats_interval_s else None
        yield
        if stats is not None:
            stats.cancel()
        loader.cancel()  # a load still running stops its engine process
        with suppress(asyncio.CancelledError):
            await loader
        if state.serving is not None:
            state.serving.close()
        if state.engine is not None:
            await state.engine.shutdown()

    app = FastAPI(title="mlaserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    app.openapi = _openapi_without_422(app)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if exc.status_code != 400 else f"invalid request body: {exc.detail}"
        return error_response(exc.status_code, str(message), headers=exc.headers)

    @app.exception_handler(RecursionError)
    async def on_too_deep(request: Request, exc: RecursionError):
        # input nested past Python's recursion limit, wherever it was read
        return error_response(400, "the request nests too deeply to be read; flatten it")

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, exc: Exception):
        logger.exception("unexpected error answering %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")

    app.add_middleware(RequestBodyMiddleware, limit=lambda: state.max_request_body_size,
                       timeout_s=state.options.body_read_timeout_s)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    def serving() -> Serving:
        if state.serving is None:
            raise APIError(503, "the model is still loading")
        return state.serving

    health_responses = {200: {"description": "the model is loaded and the engine runs"},
                        503: {"description": "the model is loading, or the engine is gone"}}

    @app.get("/health", response_class=Response, responses=health_responses)
    async def health() -> Response:
        healthy = state.serving is not None and state.engine_error is None
        return Response(status_code=200 if healthy else 503)

    @app.get("/ping", response_class=Response, responses=health_responses)
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    def model_card(name: str) -> ModelCard:
        max_len = state.serving.max_model_len if state.serving else None
        return ModelCard(id=name, created=state.created, root=model_root, max_model_len=max_len)

    @app.get("/v1/models", responses=_errors(401))
    async def models() -> ModelList:
        return ModelList(data=[model_card(name) for name in names])

    @app.get("/v1/models/{model_id:path}", responses=_errors(401, 404))
    async def model(model_id: str) -> ModelCard:
        if model_id not in names:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model")
        return model_card(model_id)

    generate_errors = _errors(400, 401, 404, 408, 413, 500, 503)
    # with `stream: true`: server-sent events, each `data:` a chunk object, an error object or
    # `[DONE]`
    stream_content = {"text/event-stream": {"schema": {
        "type": "object", "description": "one server-sent event",
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
        "required": ["data"]}}}

    @app.post("/v1/completions", response_model=None, responses={
        200: {"model": CompletionResponse, "content": stream_content}, **generate_errors})
    async def completions(req: CompletionRequest, raw_request: Request) -> Response:
        return await serving().completions(req, raw_request)

    @app.post("/v1/chat/completions", response_model=None, responses={
        200: {"model": ChatCompletionResponse, "content": stream_content}, **generate_errors})
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request) -> Response:
        serving()
        return await state.chat.chat(req, raw_request)

    @app.post("/v1/responses", response_model=None, responses={
        200: {"model": ResponsesResponse, "content": stream_content}, **generate_errors})
    async def responses(req: ResponsesRequest, raw_request: Request) -> Response:
        serving()
        return await state.responses.responses(req, raw_request)

    @app.post("/tokenize", responses=_errors(400, 401, 404, 408, 413, 503))
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await serving().tokenize(req)

    @app.post("/detokenize", responses=_errors(400, 401, 404, 408, 413, 503))
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await serving().detokenize(req)

    @app.get("/tokenizer_info", responses=_errors(401, 503))
    async def tokenizer_info() -> TokenizerInfoResponse:
        s = serving()
        tok = s.tokenizer
        info: dict[str, Any] = {}
        for key, value in tok.init_kwargs.items():
            if hasattr(value, "content"):  # AddedToken
                value = value.content
            if (isinstance(value, (str, int, float, bool)) or value is None) \
                    and _public_tokenizer_value(key, value):
                info[key] = value
        for key in ("eos_token", "bos_token", "pad_token", "unk_token"):
            info[key] = getattr(tok, key, None)
        info["chat_template"] = tok.chat_template
        info["tokenizer_class"] = type(tok).__name__
        info["model_max_length"] = s.max_model_len
        return TokenizerInfoResponse(**info)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        stats = state.engine.scheduler_stats if state.engine is not None else SchedulerStats()
        return PlainTextResponse(state.metrics.render(stats),
                                 media_type="text/plain; version=0.0.4")

    return app


def check_parser_options(options: ServingOptions) -> None:
    """ValueError for parser options that cannot work (as vLLM checks them at startup)."""
    if options.enable_auto_tool_choice and not options.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if options.tool_call_parser:
        get_tool_call_parser(options.tool_call_parser)
    if options.reasoning_parser:
        get_reasoning_parser(options.reasoning_parser)


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when it starts to stop (see ServerState.begin_drain)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.app_state = state

    async def shutdown(self, sockets: list | None = None) -> None:
        self.app_state.begin_drain(self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)


def build_server(app: FastAPI, **config: object) -> uvicorn.Server:
    """A uvicorn server for `app` (config: uvicorn.Config's keywords) that a failed model load
    or a dead engine stops, also when it runs off the main thread."""
    state: ServerState = app.state.server
    config.setdefault("http", header_timeout_protocol(state.options.header_read_timeout_s))
    server = _Server(uvicorn.Config(app, **config), state)
    state.stop = lambda: setattr(server, "should_exit", True)
    state.url = f"http://{server.config.host}:{server.config.port}"
    return server
