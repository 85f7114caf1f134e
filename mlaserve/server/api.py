"""The FastAPI app: the routers of each API (server/routes/), the HTTP guards, error bodies, and
the model loading in the background (server/state.py).

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
import logging
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlaserve import __version__
from mlaserve.engine.args import EngineArgs
from mlaserve.server.http_guards import (
    APIKeyMiddleware,
    RequestBodyMiddleware,
    error_response,
    header_timeout_protocol,
)
from mlaserve.server.metrics import ServerMetrics
from mlaserve.server.reasoning import get_reasoning_parser
from mlaserve.server.routes import openai, operations, tokenizer
from mlaserve.server.serving_base import APIError, ServingOptions
from mlaserve.server.state import ServerOptions, ServerState
from mlaserve.server.tool_calls import get_tool_call_parser

logger = logging.getLogger(__name__)


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
    if first.get("type") == "extra_forbidden":
        return f"{param}: unknown field (not part of this object in the API)", param
    return f"{param or 'body'}: {first.get('msg')}", param


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
    if isinstance(served_model_name, str):
        served_model_name = [served_model_name]
    names = tuple(served_model_name or [engine_args.model or "mlaserve-demo"])
    state = ServerState(engine_args, names, api_key, options or ServerOptions())
    speculative = engine_args.speculative_config
    state.metrics = ServerMetrics(names[0], num_speculative_tokens=0 if speculative is None
                                  else speculative.num_speculative_tokens)

    app = FastAPI(title="mlaserve", version=__version__, lifespan=_lifespan)
    app.state.server = state
    app.openapi = _openapi_without_422(app)
    for router in (operations.router, openai.router, tokenizer.router):
        app.include_router(router)
    for exception, handler in ((RequestValidationError, _on_validation_error),
                               (APIError, _on_api_error),
                               (StarletteHTTPException, _on_http_error),
                               (RecursionError, _on_too_deep),
                               (Exception, _on_unexpected_error)):
        app.add_exception_handler(exception, handler)
    app.add_middleware(RequestBodyMiddleware, limit=lambda: state.max_request_body_size,
                       timeout_s=state.options.body_read_timeout_s)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """Load the model in the background and log the stats line while the app runs; then stop
    the engine."""
    state: ServerState = app.state.server
    loader = asyncio.create_task(state.load())
    stats = asyncio.create_task(state.log_stats()) if state.options.stats_interval_s else None
    yield
    if stats is not None:
        stats.cancel()
    loader.cancel()  # a load still running stops its engine process
    with suppress(asyncio.CancelledError):
        await loader
    await state.close()


async def _on_validation_error(request: Request, exc: RequestValidationError):
    message, param = _validation_message(exc)
    return error_response(400, message, param)


async def _on_api_error(request: Request, exc: APIError):
    return exc.response()


async def _on_http_error(request: Request, exc: StarletteHTTPException):
    message = exc.detail if exc.status_code != 400 else f"invalid request body: {exc.detail}"
    return error_response(exc.status_code, str(message), headers=exc.headers)


async def _on_too_deep(request: Request, exc: RecursionError):
    # input nested past Python's recursion limit, wherever it was read
    return error_response(400, "the request nests too deeply to be read; flatten it")


async def _on_unexpected_error(request: Request, exc: Exception):
    logger.exception("unexpected error answering %s", request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}")


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
