"""The FastAPI app: OpenAI routes, tokenizer routes, health, metrics, auth and error bodies.

The app runs in the API process; the model runs in an engine-core process that the app starts
when it starts (see engine/core_client.py). /health answers 503 until the model is loaded and
warmed up, and again once the engine is gone. A model that fails to load, or an engine process
that dies, stops the HTTP server (`ServerState.stop`; `build_server` wires it to uvicorn) after
the requests in flight have been answered with the error.
"""

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from mlaserve import __version__
from mlaserve.engine.args import EngineArgs
from mlaserve.engine.core_client import AsyncEngineClient, EngineDeadError
from mlaserve.engine.messages import SchedulerStats
from mlaserve.server.formatting import error_body
from mlaserve.server.metrics import ServerMetrics
from mlaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from mlaserve.server.serving import APIError, Serving

logger = logging.getLogger(__name__)


def _terminate_this_process() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class ServerState:
    engine_args: EngineArgs
    served_model_name: str
    api_key: str | None = None
    engine: AsyncEngineClient | None = None
    serving: Serving | None = None
    load_error: BaseException | None = None
    engine_error: EngineDeadError | None = None
    metrics: ServerMetrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # stops the HTTP server; SIGTERM suits a server run on the main thread by any runner
    stop: Callable[[], None] = _terminate_this_process


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # union members add their type names to the location; keep the field path
    param = ".".join(p for p in loc if not p[:1].isupper() and "[" not in p) or None
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('msg')}", "body"
    if not loc:
        return "the request body must be a JSON object (Content-Type: application/json)", "body"
    return f"{param or 'body'}: {first.get('msg')}", param


class APIKeyMiddleware:
    """Answer 401 to /v1 requests without `Authorization: Bearer <key>`.

    A plain ASGI middleware: it looks at the headers once and then hands the connection on, so
    streamed responses pass through untouched (Starlette's BaseHTTPMiddleware would re-wrap every
    chunk of every stream).
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            if headers.get(b"authorization", b"") != self.expected:
                response = JSONResponse(error_body("invalid or missing API key",
                                                   "AuthenticationError", 401), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine_args: EngineArgs, served_model_name: str | None = None,
               api_key: str | None = None) -> FastAPI:
    """Build the app; the model loads in the background after startup (/health says 503)."""
    model_root = engine_args.model or "mlaserve-demo"
    state = ServerState(engine_args, served_model_name or model_root, api_key)
    state.metrics = ServerMetrics(state.served_model_name)

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
        state.serving = Serving(engine, state.served_model_name, model_root)
        state.engine = engine
        logger.info("model loaded; serving %s", state.served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(load())
        yield
        loader.cancel()  # a load still running stops its engine process
        with suppress(asyncio.CancelledError):
            await loader
        if state.engine is not None:
            await state.engine.shutdown()

    app = FastAPI(title="mlaserve", version=__version__, lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "BadRequestError", 400, param), status_code=400)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    def serving() -> Serving:
        if state.serving is None:
            raise APIError(503, "the model is still loading", err_type="ServiceUnavailableError")
        return state.serving

    @app.get("/health")
    async def health() -> Response:
        healthy = state.serving is not None and state.engine_error is None
        return Response(status_code=200 if healthy else 503)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        max_len = state.serving.max_model_len if state.serving else None
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": state.created,
            "owned_by": "mlaserve", "root": model_root, "parent": None,
            "max_model_len": max_len, "permission": []}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await serving().completions(req)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        return await serving().chat(req)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        s = serving()
        s.check_model(req.model)
        if req.messages is not None:
            ids = s.chat_prompt_ids(req.messages, req.add_generation_prompt, None)
        elif req.prompt is not None:
            ids = s.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        body = {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = s.tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        s = serving()
        s.check_model(req.model)
        vocab = len(s.tokenizer)
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": s.tokenizer.decode(req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        tok = serving().tokenizer
        info = {}
        for key, value in tok.init_kwargs.items():
            if isinstance(value, (str, int, float, bool)) or value is None:
                info[key] = value
            elif hasattr(value, "content"):  # AddedToken
                info[key] = value.content
        for key in ("eos_token", "bos_token", "pad_token", "unk_token"):
            info[key] = getattr(tok, key, None)
        info["chat_template"] = tok.chat_template
        info["tokenizer_class"] = type(tok).__name__
        info["model_max_length"] = serving().max_model_len
        return info

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = state.engine.scheduler_stats if state.engine is not None else SchedulerStats()
        return PlainTextResponse(state.metrics.render(stats),
                                 media_type="text/plain; version=0.0.4")

    return app


def build_server(app: FastAPI, **config: object) -> uvicorn.Server:
    """A uvicorn server for `app` (config: uvicorn.Config's keywords) that a failed model load
    or a dead engine stops, also when it runs off the main thread."""
    server = uvicorn.Server(uvicorn.Config(app, **config))
    app.state.server.stop = lambda: setattr(server, "should_exit", True)
    return server
