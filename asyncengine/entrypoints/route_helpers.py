"""What the OpenAI-style routers share: their OpenAPI declarations (the API key, request bodies, error
answers) and the served-model check."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.security import HTTPBearer
from pydantic import BaseModel

from asyncengine.engine import AsyncEngine
from asyncengine.entrypoints.api_errors import ApiError
from asyncengine.entrypoints.openai_responses import ErrorResponse
from asyncengine.entrypoints.server_state import ServerState

# NOTE: documents the API key for the schema only; GuardMiddleware checks it on /v1 (never raises here)
bearer = HTTPBearer(
    auto_error=False,
    description="the server's API key (--api-key), on /v1 and /tokenize, "
    "/detokenize; none needed without one",
)

ERRORS = {
    400: "an invalid request (`param` names the field)",
    401: "a missing or wrong API key",
    404: "no such model",
    413: "a body over --max-body-bytes",
    415: "a body that is not JSON",
    429: "the live-request limit is reached",
    503: "the model is loading, or the server shutting down",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": ERRORS[code]} for code in codes}


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring a JSON request body of one of `models` (the routes read and validate the
    raw body themselves)."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def check_model(state: ServerState, engine: AsyncEngine, model: str | None) -> str:
    """The served model's name, when a request's `model` names it (or nothing); else a 404."""
    if model not in (None, "", state.model_name, engine.config.model):
        raise ApiError(
            f"the model {model!r} does not exist; this server serves {state.model_name!r}", 404, param="model"
        )
    return state.model_name
