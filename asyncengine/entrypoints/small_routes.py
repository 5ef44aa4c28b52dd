"""The small routes: OpenAI's /v1/models, and vLLM's /tokenize, /detokenize, /version and /ping."""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from asyncengine.device_probe import resolved_device
from asyncengine.dp_engine import DataParallelEngine
from asyncengine.engine import AsyncEngine
from asyncengine.entrypoints.api_errors import ApiError
from asyncengine.entrypoints.guard import api_key_ok
from asyncengine.entrypoints.log_stats import resolved_dtype
from asyncengine.entrypoints.openai_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from asyncengine.entrypoints.openai_responses import (
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    ParallelLayout,
    TokenizeResponse,
    VersionResponse,
)
from asyncengine.entrypoints.prompts import encode_prompt, render_chat, require_tokenizer
from asyncengine.entrypoints.request_model import parse_request
from asyncengine.entrypoints.route_helpers import (
    bearer,
    check_model,
    error_responses,
    request_body,
    server_state,
)
from asyncengine.entrypoints.server_state import ServerState

router = APIRouter()
STARTED = int(time.time())


@functools.cache
def _gpu_count() -> int:
    # the launcher already asked the driver at start-up; imported here as the launcher imports this app
    from asyncengine.entrypoints.launcher import driver_gpu_count

    return driver_gpu_count()


def _dtype(engine: AsyncEngine) -> str:
    """The weights' dtype as the start-up line says it (the device matters only for a float16 checkpoint
    with --dtype auto, so the driver is asked only without --device)."""
    config = engine.config
    device = config.device if config.device != "auto" else resolved_device("auto", _gpu_count())
    return resolved_dtype(config, engine.hf_config, device)


def _card(state: ServerState, engine: AsyncEngine | DataParallelEngine) -> ModelCard:
    # NOTE: `root` is the served name, not the model's path: the server's file layout stays private
    config = engine.config
    return ModelCard(
        id=state.model_name,
        created=STARTED,
        root=state.model_name,
        max_model_len=engine.max_model_len,
        dtype=_dtype(engine),
        parallel=ParallelLayout(
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            data_parallel_size=config.data_parallel_size,
            distributed_executor_backend=config.distributed_executor_backend,
        ),
    )


@router.get(
    "/v1/models",
    response_model=ModelList,
    responses=error_responses(401, 503),
    dependencies=[Depends(bearer)],
)
async def list_models(request: Request) -> Response:
    """The served model (one)."""
    state = server_state(request)
    engine = state.require_engine()
    return JSONResponse(ModelList(data=[_card(state, engine)]).model_dump(mode="json"))


@router.get(
    "/v1/models/{model_id:path}",
    response_model=ModelCard,
    responses=error_responses(401, 404, 503),
    dependencies=[Depends(bearer)],
)
async def retrieve_model(model_id: str, request: Request) -> Response:
    """The served model's card; 404 for another id."""
    state = server_state(request)
    engine = state.require_engine()
    if model_id != state.model_name:
        raise ApiError(
            f"the model {model_id!r} does not exist; this server serves {state.model_name!r}",
            404,
            param="model",
        )
    return JSONResponse(_card(state, engine).model_dump(mode="json"))


# -- vLLM's small endpoints -------------------------------------------------------------------------
async def _require_key(request: Request) -> None:
    """The API key, where the server has one (GuardMiddleware checks it on /v1 only)."""
    key = server_state(request).api_key
    if key and not api_key_ok(request.scope["headers"], key):
        raise ApiError("invalid or missing API key", 401)


def _has_messages(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and "messages" in data


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses=error_responses(400, 401, 404, 413, 415, 503),
    openapi_extra=request_body(TokenizeCompletionRequest, TokenizeChatRequest),
    dependencies=[Depends(bearer), Depends(_require_key)],
)
async def tokenize(request: Request) -> Response:
    """vLLM's: a prompt's token ids, or those of chat messages through the chat template."""
    state = server_state(request)
    body = await request.body()
    req: TokenizeChatRequest | TokenizeCompletionRequest = parse_request(
        TokenizeChatRequest if _has_messages(body) else TokenizeCompletionRequest, body
    )
    engine = state.require_engine()
    check_model(state, engine, req.model)
    if isinstance(req, TokenizeChatRequest):
        req.check_neutral()
        ids = await asyncio.to_thread(render_chat, engine, req)
    else:
        ids = await asyncio.to_thread(encode_prompt, engine, req.prompt, req.add_special_tokens)
    strs = None
    if req.return_token_strs:
        strs = [str(t) for t in await asyncio.to_thread(require_tokenizer(engine).convert_ids_to_tokens, ids)]
    out = TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)
    return JSONResponse(out.model_dump(mode="json"))


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses=error_responses(400, 401, 404, 413, 415, 503),
    openapi_extra=request_body(DetokenizeRequest),
    dependencies=[Depends(bearer), Depends(_require_key)],
)
async def detokenize(request: Request) -> Response:
    """vLLM's: the text of token ids."""
    state = server_state(request)
    req = parse_request(DetokenizeRequest, await request.body())
    engine = state.require_engine()
    check_model(state, engine, req.model)
    tok = require_tokenizer(engine)
    if len(req.tokens) > engine.max_model_len:
        raise ApiError(f"at most max_model_len ({engine.max_model_len}) tokens", param="tokens")
    vocab = getattr(engine, "vocab_size", None) or len(tok)
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(f"token id {bad} is not in [0, {vocab})", param="tokens")
    text = await asyncio.to_thread(tok.decode, req.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump(mode="json"))


@router.get("/version", response_model=VersionResponse)
async def version() -> Response:
    """asyncengine's version."""
    try:
        value = importlib.metadata.version("asyncengine")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        value = "unknown"
    return JSONResponse({"version": value})


PING_DOWN = {503: {"model": HealthResponse, "description": "loading, shutting down or dead"}}


@router.get("/ping", response_model=HealthResponse, responses=PING_DOWN)
@router.post("/ping", response_model=HealthResponse, responses=PING_DOWN | error_responses(415))
async def ping(request: Request) -> Response:
    """vLLM's health check: /health's answer (a POST, as any here, needs Content-Type: application/json)."""
    status = server_state(request).health()
    return JSONResponse({"status": status}, 200 if status == "ok" else 503)
