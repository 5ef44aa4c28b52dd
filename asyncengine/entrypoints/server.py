"""The ASGI app: OpenAI-compatible HTTP, the /v1/ws websocket, /health and /metrics, /docs and /openapi.json,
and the browser playground at / (static files from entrypoints/static/, no API key needed to load it).

`build_app(engine=None, ...)` returns an app that can serve before the engine exists: /health answers
503 ("loading") until `app.state.server.attach(engine)`. The CLI (`asyncengine serve`) owns the engine's
and uvicorn's lifecycles, so the app itself has no lifespan work.
"""

from __future__ import annotations

import html
import importlib.metadata
import logging
from pathlib import Path
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncengine.engine import AsyncEngine
from asyncengine.entrypoints.api_errors import (
    ApiError,
    error_body,
    message_of,
    param_of,
    status_of,
)
from asyncengine.entrypoints.guard import GuardMiddleware, OriginPolicy
from asyncengine.entrypoints.openai_api import request_schemas
from asyncengine.entrypoints.openai_api import router as openai_router
from asyncengine.entrypoints.openai_responses import HealthResponse
from asyncengine.entrypoints.request_model import validation_error
from asyncengine.entrypoints.server_state import ServerLimits, ServerState
from asyncengine.entrypoints.websocket import websocket_endpoint
from asyncengine.errors import AsyncEngineError
from asyncengine.stats import exposition

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"  # the playground: plain files, no build step


def error_response(exc: BaseException) -> JSONResponse:
    status = status_of(exc)
    if status == 500:
        logger.error("request failed", exc_info=exc)
    return JSONResponse(error_body(message_of(exc), status, param_of(exc)), status)


def docs_page(schema: dict[str, Any]) -> str:
    """/docs: the endpoints of the OpenAPI schema on one plain page (no scripts: it works offline, where
    Swagger UI would fetch its JavaScript from a CDN) with a link to the schema itself."""
    rows = []
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            summary = (op.get("description") or op.get("summary") or "").strip().splitlines()
            cells = (
                f"<code>{html.escape(method.upper())}</code>",
                f"<code>{html.escape(path)}</code>",
                html.escape(summary[0] if summary else ""),
            )
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    info = schema.get("info", {})
    title = html.escape(f"{info.get('title', '')} {info.get('version', '')}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
        f"<h1>{title}</h1><p>The OpenAPI schema: <a href='/openapi.json'>/openapi.json</a> (load it into "
        "any OpenAPI viewer or client generator). The websocket <code>/v1/ws</code> is described in the "
        "README.</p><table><tr><th>method</th><th>path</th><th></th></tr>"
        + "".join(rows)
        + "</table></body></html>"
    )


def build_app(
    engine: AsyncEngine | None = None,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    model_name: str | None = None,
    policy: OriginPolicy | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The server app; `app.state.server` is its ServerState (attach the engine there when it is ready)."""

    state = ServerState(engine, api_key, limits or ServerLimits(), model_name, tool_call_parser)
    # NOTE: /docs is our own page (Swagger UI needs a CDN); /openapi.json, like /health, needs no API key
    app = FastAPI(
        title="asyncengine",
        version=_version(),
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        description="An OpenAI-compatible server (plus vLLM's extras); the websocket /v1/ws streams "
        "many requests over one connection.",
    )
    app.state.server = state
    app.include_router(openai_router)
    app.add_api_websocket_route("/v1/ws", websocket_endpoint)
    policy = policy or OriginPolicy()
    if policy.allowed_origins:  # pages of these origins may read responses too (CORS), after the guard
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(policy.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(GuardMiddleware, state=state, policy=policy)

    @app.get(
        "/health",
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "loading, shutting down or dead"}},
    )
    async def health() -> Response:
        """200 while serving ("degraded" with the dead replicas' indices when some data-parallel replicas
        died and the others serve); 503 while loading, shutting down, or dead (the status says which)."""
        status = state.health()
        if status == "degraded":
            return JSONResponse({"status": status, "dead_replicas": state.engine.degraded}, 200)
        return JSONResponse({"status": status}, 200 if status == "ok" else 503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                "description": "Prometheus' text format",
            }
        },
    )
    async def metrics() -> Response:
        """Prometheus metrics (vLLM's names with an `asyncengine:` prefix, labelled with `model_name`)."""
        engine = state.engine
        data = exposition(engine.stats.registry, state.model_name) if engine is not None else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        """The browser playground (it asks for the API key itself, where the server has one)."""
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return HTMLResponse(docs_page(app.openapi()))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
            for ops in schema.get("paths", {}).values():  # invalid requests are answered 400, never 422
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema["components"]["schemas"].pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    async def on_error(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def on_validation(request: Request, exc: Any) -> Response:
        # NOTE: OpenAI answers invalid requests with 400; FastAPI's default would be 422
        return error_response(validation_error(exc))

    async def on_http(request: Request, exc: Any) -> Response:
        return JSONResponse(
            error_body(str(exc.detail), exc.status_code),
            exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    from starlette.requests import ClientDisconnect

    async def on_client_disconnect(request: Request, exc: Exception) -> Response:
        # the client closed the connection (or missed --timeout-body) mid-body: a client event, not a
        # server error; the response goes nowhere
        logger.info(
            "%s %s: connection closed before the whole request body arrived", request.method, request.url.path
        )
        return Response(status_code=400)

    app.add_exception_handler(ApiError, on_error)
    app.add_exception_handler(AsyncEngineError, on_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(pydantic.ValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(ClientDisconnect, on_client_disconnect)
    app.add_exception_handler(Exception, on_error)
    return app


def _version() -> str:
    try:
        return importlib.metadata.version("asyncengine")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
