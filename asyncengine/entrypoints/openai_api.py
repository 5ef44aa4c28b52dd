"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both with SSE streaming); with the
small routes (/v1/models, vLLM's /tokenize, /detokenize, /version, /ping: small_routes.py) in `router`.

The request routes read the raw body and validate it themselves (FastAPI would answer 422, and turn a
body over the size limit into a 400); `openapi_extra` declares their bodies for the OpenAPI schema, whose
components `request_schemas()` provides.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from asyncengine.engine import AsyncEngine, Prompt
from asyncengine.entrypoints import small_routes
from asyncengine.entrypoints.api_errors import error_body, message_of, param_of, status_of
from asyncengine.entrypoints.chat_tools import tool_calling
from asyncengine.entrypoints.openai_format import ChatFormat, CompletionFormat, Format
from asyncengine.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from asyncengine.entrypoints.openai_responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    usage,
)
from asyncengine.entrypoints.prompts import render_chat
from asyncengine.entrypoints.request_model import parse_request
from asyncengine.entrypoints.route_helpers import (
    bearer,
    check_model,
    error_responses,
    request_body,
    server_state,
)
from asyncengine.entrypoints.server_state import ServerState
from asyncengine.entrypoints.streams import (
    ClientDisconnected,
    SSEResponse,
    generate_all,
    merge,
    open_streams,
    sse,
    until_disconnect,
)
from asyncengine.sampling_params import OutputKind, SamplingParams

router = APIRouter()
# NOTE: first, so the schema lists the small routes' paths first, as it always has
router.include_router(small_routes.router)

# -- the OpenAPI schema -----------------------------------------------------------------------------
REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
)


def request_schemas() -> dict[str, Any]:
    """The request models' JSON schemas (and the models they use), and the streamed chunks', as OpenAPI
    components (FastAPI adds those of the response models)."""
    ref = "#/components/schemas/{model}"
    _, requests = models_json_schema([(m, "validation") for m in REQUEST_MODELS], ref_template=ref)
    _, chunks = models_json_schema([(ChatCompletionChunk, "serialization")], ref_template=ref)
    return {**chunks.get("$defs", {}), **requests.get("$defs", {})}


def _json_or_sse(model: type[BaseModel], chunk: str) -> dict[int | str, dict[str, Any]]:
    """A 200 of `model`, or with `stream: true` server-sent events of `chunk`s (or one error) and [DONE]."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "anyOf": [
                {"$ref": f"#/components/schemas/{chunk}"},
                {"$ref": "#/components/schemas/ErrorResponse"},
            ]
        },
    }
    event = {
        "type": "object",
        "required": ["data"],  # OpenAPI 3.1: the schema of one event
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
    }
    return {
        200: {
            "model": model,
            "description": f"the whole response; with `stream: true`, server-sent events, each `data:` "
            f"a JSON {chunk} (or an error that ends the stream), the last `[DONE]`",
            "content": {"text/event-stream": {"schema": event}},
        }
    }


GENERATE_ERRORS = error_responses(400, 401, 404, 413, 415, 429, 503)


# -- /v1/completions --------------------------------------------------------------------------------
@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses=_json_or_sse(CompletionResponse, "CompletionResponse") | GENERATE_ERRORS,
    openapi_extra=request_body(CompletionRequest),
    dependencies=[Depends(bearer)],
)
async def completions(request: Request) -> Response:
    """OpenAI's (legacy) completions, with vLLM's sampling extras."""
    state = server_state(request)
    req = parse_request(CompletionRequest, await request.body())
    engine = state.require_engine()
    model = check_model(state, engine, req.model)
    params = await _sampling_params(req)
    prompts = req.prompts()
    return await _serve(
        request,
        state,
        engine,
        prompts,
        params,
        f"cmpl-{uuid.uuid4().hex}",
        model,
        req.include_usage,
        CompletionFormat(engine, req.logprobs is not None, req.return_token_ids),
    )


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=_json_or_sse(ChatCompletionResponse, "ChatCompletionChunk") | GENERATE_ERRORS,
    openapi_extra=request_body(ChatCompletionRequest),
    dependencies=[Depends(bearer)],
)
async def chat_completions(request: Request) -> Response:
    """OpenAI's chat completions (text only), with tool calling, structured output, and vLLM's sampling and
    chat-template extras."""
    state = server_state(request)
    req = parse_request(ChatCompletionRequest, await request.body())
    engine = state.require_engine()
    model = check_model(state, engine, req.model)
    params = await _sampling_params(req)
    tools = tool_calling(req, getattr(engine.tokenizer, "chat_template", None), state.tool_call_parser)
    # a template over long messages and their tokenizing take a while: off the loop, other streams go on
    prompt = await asyncio.to_thread(render_chat, engine, req)
    fmt = ChatFormat(engine, req.top_logprobs or 0 if req.logprobs else None, tools)
    return await _serve(
        request,
        state,
        engine,
        [prompt],
        params,
        f"chatcmpl-{uuid.uuid4().hex}",
        model,
        req.include_usage,
        fmt,
    )


async def _sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    # checking a constraint compiles it, which takes a while for a large one: off the loop, streams go on
    return await asyncio.to_thread(req.sampling_params) if req.constrains else req.sampling_params()


async def _serve(
    request: Request,
    state: ServerState,
    engine: AsyncEngine,
    prompts: list[Prompt],
    params: SamplingParams,
    request_id: str,
    model: str,
    include_usage: bool,
    fmt: Format,
) -> Response:
    """Runs the prompts and answers with one JSON body, or SSE when params stream deltas."""
    slots = state.acquire(len(prompts))
    created = int(time.time())
    if params.output_kind != OutputKind.DELTA:
        try:
            finals = await until_disconnect(request, generate_all(engine, prompts, params, request_id))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody is listening; the requests are aborted
        finally:
            state.release(slots)
        return JSONResponse(fmt.full(request_id, created, model, finals, params.n).model_dump(mode="json"))
    try:
        streams = await open_streams(engine, prompts, params, request_id)
    except BaseException:
        state.release(slots)
        raise
    return SSEResponse(
        _events(state, slots, streams, request_id, created, model, params.n, include_usage, fmt),
        state.limits,
        request_id,
    )


async def _events(
    state: ServerState,
    slots: int,
    streams: list,
    request_id: str,
    created: int,
    model: str,
    n: int,
    include_usage: bool,
    fmt: Format,
) -> AsyncIterator[str]:
    finished: set[int] = set()
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    merged = merge(streams)
    try:
        async for i, out in merged:
            prompt_tokens[i] = len(out.prompt_token_ids)
            for c in out.outputs:
                index = i * n + c.index
                if index in finished:
                    continue
                completion_tokens += len(c.token_ids)
                if c.finish_reason is not None:
                    finished.add(index)
                for chunk in fmt.chunks(request_id, created, model, index, c):
                    yield sse(chunk)
        if include_usage:
            total = usage(sum(prompt_tokens.values()), completion_tokens)
            yield sse(fmt.usage_chunk(request_id, created, model, total))
    except Exception as e:  # headers are gone: report in-band, as OpenAI and vLLM do
        yield sse(json.dumps(error_body(message_of(e), status_of(e), param_of(e))))
    finally:
        await merged.aclose()  # stops the pumps before their streams are closed (which aborts the rest)
        for s in streams:
            await s.aclose()
        state.release(slots)
    yield "data: [DONE]\n\n"
