"""What the HTTP layer bounds before a handler runs: the API key, a request body's size and the
time its body and headers may take to arrive.

Plain ASGI middlewares (Starlette's BaseHTTPMiddleware would re-wrap every chunk of every stream)
and a subclass of uvicorn's HTTP protocol. A client that sends its headers or its body slowly
(slowloris) holds a connection and a handler open for as long as it likes unless a deadline
closes them: uvicorn times out idle keep-alive connections but not a request in the making, so
`HeaderTimeoutProtocol` closes a connection whose request headers have not all arrived in time,
and `RequestBodyMiddleware` answers 408 (and closes) when a body has not.
"""

import asyncio
import hmac
from collections.abc import Callable

from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from mlaserve.server.serving_base import APIError

# Paths that need the API key when the server has one (besides everything under /v1).
KEYED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None):
    """An OpenAI error body with its status."""
    return APIError(status, message, param, headers=headers).response()


class APIKeyMiddleware:
    """Answer 401 to /v1 and tokenizer requests without `Authorization: Bearer <key>`.

    It looks at the headers once and then hands the connection on, so streamed responses pass
    through untouched. The key is compared in constant time.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1")
                                        or scope["path"] in KEYED_PATHS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestBodyTooLarge(StarletteHTTPException):
    """Raised from `receive` once a body passes the limit; FastAPI re-raises HTTPExceptions met
    while it reads a body, and the app's handler answers it as an OpenAI 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes "
                              "(--max-request-body-size)")


class RequestBodyTimeout(StarletteHTTPException):
    """Raised from `receive` when a body has not arrived in time; answered 408, and the
    connection is closed (the rest of the body is never read)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s "
                              "(--body-read-timeout)", headers={"Connection": "close"})


class RequestBodyMiddleware:
    """Answer 413 to a request whose body is over the limit without reading it (at once when
    Content-Length says so, else as soon as the bytes received pass the limit), and 408 to one
    whose body has not all arrived `timeout_s` after the handler began to read it.

    Starlette's RequestBodyLimitMiddleware answers text/plain and takes a fixed limit; this
    one's default follows max_model_len, known once the model is loaded.
    """

    def __init__(self, app, limit: Callable[[], int], timeout_s: float) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await error_response(413, RequestBodyTooLarge(limit).detail)(scope, receive, send)
            return
        received = 0
        deadline: float | None = None
        body_done = False
        loop = asyncio.get_running_loop()

        async def limited_receive() -> dict:
            nonlocal received, deadline, body_done
            if body_done:  # afterwards the handler only listens for a disconnect
                return await receive()
            if deadline is None:
                deadline = loop.time() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise RequestBodyTimeout(self.timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestBodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's HTTP protocol (httptools' or h11's, as uvicorn picks) closing a connection
    whose request headers have not all arrived `timeout_s` after it opened or after its last
    response ended (uvicorn's keep-alive timeout covers an idle connection, not a request
    arriving byte by byte)."""

    class HeaderTimeoutProtocol(AutoHTTPProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(timeout_s, self._headers_late, self.cycle)

        def _headers_late(self, cycle_then) -> None:
            """No new request since the timer was armed: its headers are late."""
            self._header_timer = None
            waiting = cycle_then is None or cycle_then.response_complete
            if self.cycle is cycle_then and waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
