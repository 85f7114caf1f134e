"""The API server's state: its options (`ServerOptions`, the `mlaserve serve` flags beyond the
engine's) and `ServerState`, what the routes read: the engine client once the model is loaded,
the request handlers built on it, the metrics, and why the server stopped if it did.

The model loads in the background once the app starts (`ServerState.load`); until then the
routes that need it answer 503 (`serving`). A failed load, or an engine process that dies,
stops the HTTP server (`ServerState.stop`, which `api.build_server` wires to uvicorn) after the
requests in flight have been answered with the error.
"""

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cached_property

from fastapi import Request

from mlaserve.engine.args import DEMO_MODEL_DIR, EngineArgs
from mlaserve.engine.core_client import AsyncEngineClient, EngineDeadError
from mlaserve.engine.generation_config import default_sampling
from mlaserve.server.metrics import ServerMetrics
from mlaserve.server.serving import Serving
from mlaserve.server.serving_base import APIError, ServingOptions
from mlaserve.server.serving_chat import ChatServing
from mlaserve.server.serving_responses import ResponsesServing

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
    def model_root(self) -> str:
        """The model directory as given to `serve` (clients load the tokenizer from it)."""
        return self.engine_args.model or str(DEMO_MODEL_DIR)

    @property
    def max_model_len(self) -> int | None:
        """The context length served: the engine's once loaded, before that the one its
        arguments and the model's config give (None if they cannot be read; loading says
        why)."""
        if self.serving is not None:
            return self.serving.max_model_len
        return self._configured_max_model_len

    @cached_property
    def _configured_max_model_len(self) -> int | None:
        from mlaserve.config import ModelConfig
        from mlaserve.engine.args import model_dir_of
        from mlaserve.engine.engine_config import resolve_max_model_len

        try:
            model = ModelConfig.from_pretrained(model_dir_of(self.engine_args),
                                                self.engine_args.hf_overrides)
            return resolve_max_model_len(self.engine_args, model)
        except Exception:  # noqa: BLE001 - the engine's load reports it
            return None

    @property
    def max_request_body_size(self) -> int:
        if self.options.max_request_body_size is not None:
            return self.options.max_request_body_size
        max_model_len = self.serving.max_model_len if self.serving is not None else 0
        return BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * max_model_len

    async def load(self) -> None:
        """Start the engine and build the request handlers on it; a failure stops the
        server."""
        try:
            engine = await AsyncEngineClient.start(self.engine_args, self.metrics,
                                                   self._on_engine_dead)
        except Exception as exc:  # noqa: BLE001 - reported, then the server stops
            logger.error("model failed to load: %s", exc)
            self.load_error = exc
            self.stop()
            return
        options = ServingOptions(**{
            **{f.name: getattr(self.options, f.name) for f in fields(ServingOptions)},
            "max_num_seqs": self.engine_args.max_num_seqs,
            "default_sampling": default_sampling(self.engine_args)})
        serving = Serving(engine, self.served_model_names, self.model_root, options)
        if self.metrics is not None:
            serving.metrics = self.metrics
            args = self.engine_args
            self.metrics.set_cache_config({
                "block_size": args.block_size, "cache_dtype": args.kv_cache_dtype,
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "enable_prefix_caching": args.enable_prefix_caching,
                "num_gpu_blocks": engine.info.kv_capacity_tokens // args.block_size,
                "num_cpu_blocks": None})
        self.chat = ChatServing(serving)
        self.responses = ResponsesServing(self.chat)
        # start-up's objects (torch, transformers, the tokenizer) live as long as the process:
        # out of the collector's reach, a full collection no longer walks them (it blocked the
        # event loop for ~250 ms)
        gc.collect()
        gc.freeze()
        self.serving = serving
        self.engine = engine
        logger.info("serving on %s (model %s)", self.url or "the configured address",
                    ", ".join(self.served_model_names))

    def _on_engine_dead(self, error: EngineDeadError) -> None:
        logger.error("%s; stopping the server", error)
        self.engine_error = error
        self.stop()

    async def log_stats(self) -> None:
        """vLLM's stats line every stats_interval_s; at debug level once two intervals in a row
        had no tokens (ServerMetrics.interval_was_idle)."""
        while True:
            await asyncio.sleep(self.options.stats_interval_s)
            stats_line = getattr(self.metrics, "stats_line", None)
            if self.engine is None or stats_line is None:
                continue
            line = stats_line(self.engine.scheduler_stats)
            idle = getattr(self.metrics, "interval_was_idle", False)
            logger.log(logging.DEBUG if idle else logging.INFO, "%s", line)

    async def close(self) -> None:
        """Stop the request handlers' processes and the engine."""
        if self.serving is not None:
            self.serving.close()
        if self.engine is not None:
            await self.engine.shutdown()

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


def server_state(request: Request) -> ServerState:
    """The state of the app a request reached."""
    return request.app.state.server


def serving(request: Request) -> Serving:
    """The request handlers, or 503 while the model loads."""
    state = server_state(request)
    if state.serving is None:
        raise APIError(503, "the model is still loading")
    return state.serving
