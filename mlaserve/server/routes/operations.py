"""The routes an operator or a load balancer asks: /health, /ping, /version and /metrics."""

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from mlaserve import __version__
from mlaserve.engine.messages import SchedulerStats
from mlaserve.server.protocol_extras import VersionResponse
from mlaserve.server.state import server_state

router = APIRouter()
HEALTH_RESPONSES = {200: {"description": "the model is loaded and the engine runs"},
                    503: {"description": "the model is loading, or the engine is gone"}}


@router.get("/health", response_class=Response, responses=HEALTH_RESPONSES)
async def health(request: Request) -> Response:
    state = server_state(request)
    healthy = state.serving is not None and state.engine_error is None
    return Response(status_code=200 if healthy else 503)


@router.get("/ping", response_class=Response, responses=HEALTH_RESPONSES)
async def ping(request: Request) -> Response:
    return await health(request)


@router.post("/ping", response_class=Response, responses=HEALTH_RESPONSES)
async def ping_post(request: Request) -> Response:
    """POST /ping, as vLLM (and SageMaker's health check) takes it."""
    return await health(request)


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    state = server_state(request)
    stats = state.engine.scheduler_stats if state.engine is not None else SchedulerStats()
    return PlainTextResponse(state.metrics.render(stats), media_type="text/plain; version=0.0.4")
