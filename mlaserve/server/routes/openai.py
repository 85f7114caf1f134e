"""OpenAI's routes: /v1/completions, /v1/chat/completions, /v1/responses and /v1/models."""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mlaserve.server.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from mlaserve.server.protocol_completions import CompletionRequest, CompletionResponse
from mlaserve.server.protocol_extras import ModelCard, ModelList
from mlaserve.server.protocol_responses import ResponsesRequest, ResponsesResponse
from mlaserve.server.routes.docs import STREAM_CONTENT, errors
from mlaserve.server.serving_base import APIError
from mlaserve.server.state import ServerState, server_state, serving

router = APIRouter()
GENERATE_ERRORS = errors(400, 401, 404, 408, 413, 500, 503)


@router.post("/v1/completions", response_model=None, responses={
    200: {"model": CompletionResponse, "content": STREAM_CONTENT}, **GENERATE_ERRORS})
async def completions(req: CompletionRequest, raw_request: Request) -> Response:
    return await serving(raw_request).completions(req, raw_request)


@router.post("/v1/chat/completions", response_model=None, responses={
    200: {"model": ChatCompletionResponse, "content": STREAM_CONTENT}, **GENERATE_ERRORS})
async def chat_completions(req: ChatCompletionRequest, raw_request: Request) -> Response:
    serving(raw_request)
    return await server_state(raw_request).chat.chat(req, raw_request)


@router.post("/v1/responses", response_model=None, responses={
    200: {"model": ResponsesResponse, "content": STREAM_CONTENT}, **GENERATE_ERRORS})
async def responses(req: ResponsesRequest, raw_request: Request) -> Response:
    serving(raw_request)
    return await server_state(raw_request).responses.responses(req, raw_request)


def _model_card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.created, root=state.model_root,
                     max_model_len=state.max_model_len)


@router.get("/v1/models", responses=errors(401))
async def models(request: Request) -> ModelList:
    state = server_state(request)
    return ModelList(data=[_model_card(state, name) for name in state.served_model_names])


@router.get("/v1/models/{model_id:path}", responses=errors(401, 404))
async def model(model_id: str, request: Request) -> ModelCard:
    state = server_state(request)
    if model_id not in state.served_model_names:
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model")
    return _model_card(state, model_id)
