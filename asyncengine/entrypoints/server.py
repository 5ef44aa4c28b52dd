"""The ASGI app: OpenAI-compatible HTTP, the /v1/ws websocket, /health and /metrics.

`build_app(engine=None, ...)` returns an app that can serve before the engine exists: /health answers
503 ("loading") until `app.state.server.attach(engine)`. The CLI (`asyncengine serve`) owns the engine's
and uvicorn's lifecycles, so the app itself has no lifespan work.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asyncengine.engine import AsyncEngine
from asyncengine.entrypoints.api_errors import (
    ApiError,
    NotReadyError,
    PayloadTooLargeError,
    TooManyRequestsError,
    error_body,
    message_of,
    status_of,
)
from asyncengine.errors import AsyncEngineError, EngineDeadError, EngineShutdownError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    max_live_requests: int = 4096  # generating requests, HTTP and websocket together
    max_live_per_connection: int = 1024  # generating requests on one websocket
    max_body_bytes: int = 10 * 2**20  # HTTP request body
    max_frame_bytes: int = 2**20  # websocket text frame


class ServerState:
    """What the routes share: the engine (None while loading), limits, the API key, live-request count."""

    def __init__(self, engine: AsyncEngine | None, api_key: str | None, limits: ServerLimits,
                 model_name: str | None) -> None:
        self.engine: AsyncEngine | None = None
        self.api_key = api_key
        self.limits = limits
        self.model_name = model_name or ""
        self.live = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: AsyncEngine) -> None:
        """Starts serving `engine`; /health turns 200."""
        self.engine = engine
        if not self.model_name:
            self.model_name = Path(engine.config.model).name

    def require_engine(self) -> AsyncEngine:
        """The engine, or a 503 error while loading, draining, shutting down or dead."""
        if self.draining:
            raise NotReadyError("the server is shutting down")
        engine = self.engine
        if engine is None:
            raise NotReadyError("the model is still loading")
        if engine.dead is not None:
            raise EngineDeadError(f"the engine is dead: {engine.dead}")
        if engine.closing:
            raise EngineShutdownError("the engine is shutting down")
        return engine

    def health(self) -> str:
        if self.engine is None:
            return "loading"
        if self.engine.dead is not None:
            return "dead"
        if self.draining or not self.engine.is_running:
            return "shutting_down"
        return "ok"

    def acquire(self, count: int = 1) -> int:
        """Takes `count` slots of the global live-request limit (429 when they are not free)."""
        if self.live + count > self.limits.max_live_requests:
            raise TooManyRequestsError(f"the server has {self.live} live requests "
                                       f"(limit {self.limits.max_live_requests}); retry later")
        self.live += count
        self._idle.clear()
        return count

    def release(self, count: int = 1) -> None:
        self.live -= count
        if self.live <= 0:
            self.live = 0
            self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Refuses new requests and waits up to timeout_s for live ones; True if all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False


def api_key_ok(headers: list[tuple[bytes, bytes]], api_key: str) -> bool:
    value = next((v for k, v in headers if k == b"authorization"), b"")
    scheme, _, token = value.partition(b" ")
    # constant-time, so a wrong key leaks nothing about the right one through timing
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode())


class GuardMiddleware:
    """Pure ASGI: checks the API key on /v1 (HTTP and websocket) and bounds HTTP body size."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        protected = scope["type"] in ("http", "websocket") and scope["path"].startswith("/v1")
        if protected and self.state.api_key and not api_key_ok(scope["headers"], self.state.api_key):
            if scope["type"] == "websocket":
                await self._reject_websocket(scope, receive, send)
            else:
                await JSONResponse(error_body("invalid or missing API key", 401), 401)(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.state.limits.max_body_bytes
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        if length.isdigit() and int(length) > limit:
            body = error_body(f"request body over {limit} bytes", 413)
            await JSONResponse(body, 413)(scope, receive, send)
            return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # chunked bodies carry no content-length
                raise PayloadTooLargeError(f"request body over {limit} bytes")
            return message

        await self.app(scope, bounded_receive, send)

    @staticmethod
    async def _reject_websocket(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # websocket.connect
        if "websocket.http.response" in scope.get("extensions", {}):
            await JSONResponse(error_body("invalid or missing API key", 401), 401)(scope, receive, send)
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})


def error_response(exc: BaseException) -> JSONResponse:
    status = status_of(exc)
    if status == 500:
        logger.error("request failed", exc_info=exc)
    return JSONResponse(error_body(message_of(exc), status), status)


def validation_message(exc: RequestValidationError | pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def build_app(engine: AsyncEngine | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None, model_name: str | None = None) -> FastAPI:
    """The server app; `app.state.server` is its ServerState (attach the engine there when it is ready)."""
    from asyncengine.entrypoints.openai_api import router as openai_router
    from asyncengine.entrypoints.websocket import websocket_endpoint

    state = ServerState(engine, api_key, limits or ServerLimits(), model_name)
    app = FastAPI(title="asyncengine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.include_router(openai_router)
    app.add_api_websocket_route("/v1/ws", websocket_endpoint)
    app.add_middleware(GuardMiddleware, state=state)

    @app.get("/health")
    async def health() -> Response:
        status = state.health()
        return JSONResponse({"status": status}, 200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        data = generate_latest(state.engine.stats.registry) if state.engine is not None else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    async def on_error(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def on_validation(request: Request, exc: Any) -> Response:
        # NOTE: OpenAI answers invalid requests with 400; FastAPI's default would be 422
        return JSONResponse(error_body(validation_message(exc), 400), 400)

    async def on_http(request: Request, exc: Any) -> Response:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code,
                            headers=getattr(exc, "headers", None))

    app.add_exception_handler(ApiError, on_error)
    app.add_exception_handler(AsyncEngineError, on_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(pydantic.ValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_error)
    return app
