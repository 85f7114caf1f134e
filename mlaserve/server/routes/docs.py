"""What the routes declare for the OpenAPI schema: their error answers and the stream format."""

from typing import Any

from mlaserve.server.protocol import ErrorResponse

_ERRORS = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
           408: "request body too slow", 413: "request body too large", 500: "engine failure",
           503: "model loading, server at capacity or stopping"}

# with `stream: true`: server-sent events, each `data:` a chunk object, an error object or
# `[DONE]`
STREAM_CONTENT = {"text/event-stream": {"schema": {
    "type": "object", "description": "one server-sent event",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"]}}}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries of the error codes a route can answer."""
    return {code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in codes}
