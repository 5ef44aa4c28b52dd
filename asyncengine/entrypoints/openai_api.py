"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models;
and vLLM's small ones: /tokenize, /detokenize, /version, /ping.

The request routes read the raw body and validate it themselves (FastAPI would answer 422, and turn a
body over the size limit into a 400); `openapi_extra` declares their bodies for the OpenAPI schema, whose
components `request_schemas()` provides.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from asyncengine.engine import AsyncEngine, Prompt
from asyncengine.entrypoints.api_errors import ApiError, error_body, message_of, param_of, status_of
from asyncengine.entrypoints.guard import api_key_ok
from asyncengine.entrypoints.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTemplateFields,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    VersionResponse,
    parse_request,
    template_chars,
    usage,
)
from asyncengine.entrypoints.server_state import ServerState
from asyncengine.entrypoints.streams import (
    MIN_LOGPROB,
    ClientDisconnected,
    SSEResponse,
    clamp,
    generate_all,
    merge,
    open_streams,
    sse,
    until_disconnect,
)
from asyncengine.outputs import CompletionOutput, Logprob
from asyncengine.sampling_params import OutputKind, SamplingParams

# NOTE: documents the API key for the schema only; GuardMiddleware checks it on /v1 (never raises here)
bearer = HTTPBearer(
    auto_error=False,
    description="the server's API key (--api-key), on /v1 and /tokenize, "
    "/detokenize; none needed without one",
)
router = APIRouter()
STARTED = int(time.time())

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


def _body(*models: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring a JSON request body of one of `models`."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


ERRORS = {
    400: "an invalid request (`param` names the field)",
    401: "a missing or wrong API key",
    404: "no such model",
    413: "a body over --max-body-bytes",
    415: "a body that is not JSON",
    429: "the live-request limit is reached",
    503: "the model is loading, or the server shutting down",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": ERRORS[code]} for code in codes}


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


GENERATE_ERRORS = _errors(400, 401, 404, 413, 415, 429, 503)


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _check_model(state: ServerState, engine: AsyncEngine, model: str | None) -> str:
    if model not in (None, "", state.model_name, engine.config.model):
        raise ApiError(
            f"the model {model!r} does not exist; this server serves {state.model_name!r}", 404, param="model"
        )
    return state.model_name


def _card(state: ServerState, engine: AsyncEngine) -> ModelCard:
    # NOTE: `root` is the served name, not the model's path: the server's file layout stays private
    return ModelCard(
        id=state.model_name, created=STARTED, root=state.model_name, max_model_len=engine.max_model_len
    )


@router.get(
    "/v1/models", response_model=ModelList, responses=_errors(401, 503), dependencies=[Depends(bearer)]
)
async def list_models(request: Request) -> Response:
    """The served model (one)."""
    state = _state(request)
    engine = state.require_engine()
    return JSONResponse(ModelList(data=[_card(state, engine)]).model_dump(mode="json"))


@router.get(
    "/v1/models/{model_id:path}",
    response_model=ModelCard,
    responses=_errors(401, 404, 503),
    dependencies=[Depends(bearer)],
)
async def retrieve_model(model_id: str, request: Request) -> Response:
    """The served model's card; 404 for another id."""
    state = _state(request)
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
    key = _state(request).api_key
    if key and not api_key_ok(request.scope["headers"], key):
        raise ApiError("invalid or missing API key", 401)


def _tokenizer(engine: AsyncEngine) -> Any:
    if engine.tokenizer is None:
        raise ApiError("this model has no tokenizer")
    return engine.tokenizer


def encode_prompt(engine: AsyncEngine, prompt: str, add_special_tokens: bool) -> list[int]:
    """A prompt's token ids (slow on long prompts: call it in a thread), bounded as the engine's are."""
    tok = _tokenizer(engine)
    if len(prompt) > engine.max_prompt_chars:
        raise ApiError(
            f"the prompt has {len(prompt)} characters, more than max_model_len "
            f"({engine.max_model_len}) tokens can hold",
            param="prompt",
        )
    try:
        return list(tok.encode(prompt, add_special_tokens=add_special_tokens))
    except TypeError:  # the Rust tokenizer refuses what UTF-8 cannot hold: lone surrogates ("\ud800")
        raise ApiError("the prompt is not valid Unicode (a lone surrogate?)", param="prompt") from None


def _has_messages(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and "messages" in data


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses=_errors(400, 401, 404, 413, 415, 503),
    openapi_extra=_body(TokenizeCompletionRequest, TokenizeChatRequest),
    dependencies=[Depends(bearer), Depends(_require_key)],
)
async def tokenize(request: Request) -> Response:
    """vLLM's: a prompt's token ids, or those of chat messages through the chat template."""
    state = _state(request)
    body = await request.body()
    req: TokenizeChatRequest | TokenizeCompletionRequest = parse_request(
        TokenizeChatRequest if _has_messages(body) else TokenizeCompletionRequest, body
    )
    engine = state.require_engine()
    _check_model(state, engine, req.model)
    if isinstance(req, TokenizeChatRequest):
        req.check_neutral()
        ids = await asyncio.to_thread(render_chat, engine, req)
    else:
        ids = await asyncio.to_thread(encode_prompt, engine, req.prompt, req.add_special_tokens)
    strs = None
    if req.return_token_strs:
        strs = [str(t) for t in await asyncio.to_thread(_tokenizer(engine).convert_ids_to_tokens, ids)]
    out = TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)
    return JSONResponse(out.model_dump(mode="json"))


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses=_errors(400, 401, 404, 413, 415, 503),
    openapi_extra=_body(DetokenizeRequest),
    dependencies=[Depends(bearer), Depends(_require_key)],
)
async def detokenize(request: Request) -> Response:
    """vLLM's: the text of token ids."""
    state = _state(request)
    req = parse_request(DetokenizeRequest, await request.body())
    engine = state.require_engine()
    _check_model(state, engine, req.model)
    tok = _tokenizer(engine)
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
@router.post("/ping", response_model=HealthResponse, responses=PING_DOWN | _errors(415))
async def ping(request: Request) -> Response:
    """vLLM's health check: /health's answer (a POST, as any here, needs Content-Type: application/json)."""
    status = _state(request).health()
    return JSONResponse({"status": status}, 200 if status == "ok" else 503)


# -- logprobs ---------------------------------------------------------------------------------------
def _token_text(token_id: int, lp: Logprob | None, engine: AsyncEngine) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return engine.tokenizer.decode([token_id]) if engine.tokenizer is not None else f"token_id:{token_id}"


def completion_logprobs(c: CompletionOutput, engine: AsyncEngine, offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs object; text_offset counts from `offset` (characters streamed so far)."""
    out = CompletionLogprobs()
    for token_id, table in zip(c.token_ids, c.logprobs or []):
        sampled = table.get(token_id)
        text = _token_text(token_id, sampled, engine)
        out.tokens.append(text)
        out.token_logprobs.append(clamp(sampled.logprob) if sampled else None)
        out.top_logprobs.append({_token_text(t, lp, engine): clamp(lp.logprob) for t, lp in table.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(c: CompletionOutput, engine: AsyncEngine, top_n: int) -> ChatLogprobs:
    content = []
    for token_id, table in zip(c.token_ids, c.logprobs or []):
        sampled = table.get(token_id)
        text = _token_text(token_id, sampled, engine)
        top = sorted(table.items(), key=lambda kv: kv[1].rank)[:top_n]
        content.append(
            TokenLogprob(
                token=text,
                logprob=clamp(sampled.logprob) if sampled else MIN_LOGPROB,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=(s := _token_text(t, lp, engine)),
                        logprob=clamp(lp.logprob),
                        bytes=list(s.encode()),
                    )
                    for t, lp in top
                ],
            )
        )
    return ChatLogprobs(content=content)


# -- /v1/completions --------------------------------------------------------------------------------
@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses=_json_or_sse(CompletionResponse, "CompletionResponse") | GENERATE_ERRORS,
    openapi_extra=_body(CompletionRequest),
    dependencies=[Depends(bearer)],
)
async def completions(request: Request) -> Response:
    """OpenAI's (legacy) completions, with vLLM's sampling extras."""
    state = _state(request)
    req = parse_request(CompletionRequest, await request.body())
    engine = state.require_engine()
    model = _check_model(state, engine, req.model)
    params = req.sampling_params()
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
        _CompletionFormat(engine, req.logprobs is not None, req.return_token_ids),
    )


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=_json_or_sse(ChatCompletionResponse, "ChatCompletionChunk") | GENERATE_ERRORS,
    openapi_extra=_body(ChatCompletionRequest),
    dependencies=[Depends(bearer)],
)
async def chat_completions(request: Request) -> Response:
    """OpenAI's chat completions (text only), with vLLM's sampling and chat-template extras."""
    state = _state(request)
    req = parse_request(ChatCompletionRequest, await request.body())
    engine = state.require_engine()
    model = _check_model(state, engine, req.model)
    params = req.sampling_params()
    # a template over long messages and their tokenizing take a while: off the loop, other streams go on
    prompt = await asyncio.to_thread(render_chat, engine, req)
    fmt = _ChatFormat(engine, req.top_logprobs or 0 if req.logprobs else None)
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


def render_chat(engine: AsyncEngine, req: ChatTemplateFields) -> list[int]:
    """The prompt token ids from the tokenizer's chat template (slow on long messages: call it in a
    thread)."""
    tok = engine.tokenizer
    if tok is None:
        raise ApiError(
            "this model has no tokenizer, so chat is unavailable: use /v1/completions with token ids"
        )
    if not getattr(tok, "chat_template", None):
        raise ApiError("this model's tokenizer has no chat template: use /v1/completions")
    messages = [m.as_template_input() for m in req.messages]
    kwargs = req.template_kwargs()
    if req.continue_final_message:  # only then: a template call of older transformers knows no such argument
        kwargs["continue_final_message"] = True
    chars = template_chars(messages) + len(json.dumps(kwargs, default=str))
    if chars > engine.max_prompt_chars:
        raise ApiError(
            f"the messages have {chars} characters, more than max_model_len "
            f"({engine.max_model_len}) tokens can hold",
            param="messages",
        )
    try:
        text = tok.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tokenize=False, **kwargs
        )
    except Exception as e:  # jinja raises anything (templates call raise_exception on bad roles)
        raise ApiError(f"cannot apply the chat template: {e}", param="messages") from None
    # NOTE: the template already wrote any BOS; encoding with special tokens (by default) would add another
    try:
        return list(tok.encode(text, add_special_tokens=req.add_special_tokens))
    except TypeError:  # lone surrogates
        raise ApiError("the messages are not valid Unicode (a lone surrogate?)", param="messages") from None


async def _serve(
    request: Request,
    state: ServerState,
    engine: AsyncEngine,
    prompts: list[Prompt],
    params: SamplingParams,
    request_id: str,
    model: str,
    include_usage: bool,
    fmt: _Format,
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
    fmt: _Format,
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
                elif not c.text and not (c.token_ids and (fmt.has_logprobs or fmt.token_ids)):
                    continue  # nothing to show yet (e.g. half a UTF-8 character is held back)
                yield sse(fmt.chunk(request_id, created, model, index, c))
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


class _Format:
    """How one endpoint spells its responses; streaming when params ask for deltas."""

    has_logprobs = False
    token_ids = False  # chunks carry token ids (so a chunk with ids and no text yet is still sent)

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.offsets: dict[int, int] = {}

    def full(self, request_id: str, created: int, model: str, finals: list, n: int) -> Any:
        raise NotImplementedError

    def chunk(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> str:
        raise NotImplementedError

    def usage_chunk(self, request_id: str, created: int, model: str, total: Any) -> str:
        raise NotImplementedError


class _CompletionFormat(_Format):
    def __init__(self, engine: AsyncEngine, logprobs: bool, token_ids: bool = False) -> None:
        super().__init__(engine)
        self.has_logprobs = logprobs
        self.token_ids = token_ids

    def _lp(self, index: int, c: CompletionOutput) -> CompletionLogprobs | None:
        if not self.has_logprobs:
            return None
        lp = completion_logprobs(c, self.engine, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + len(c.text)
        return lp

    def full(self, request_id: str, created: int, model: str, finals: list, n: int) -> CompletionResponse:
        ids = self.token_ids
        choices = [
            CompletionChoice(
                index=i * n + c.index,
                text=c.text,
                logprobs=self._lp(i * n + c.index, c),
                finish_reason=c.finish_reason,
                token_ids=list(c.token_ids) if ids else None,
                prompt_token_ids=list(out.prompt_token_ids) if ids else None,
            )
            for i, out in enumerate(finals)
            for c in out.outputs
        ]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage(prompt_tokens, completion_tokens),
        )

    def chunk(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> str:
        choice = CompletionChoice(
            index=index,
            text=c.text,
            logprobs=self._lp(index, c),
            finish_reason=c.finish_reason,
            token_ids=list(c.token_ids) if self.token_ids else None,
        )
        return CompletionResponse(
            id=request_id, created=created, model=model, choices=[choice]
        ).model_dump_json()

    def usage_chunk(self, request_id: str, created: int, model: str, total: Any) -> str:
        return CompletionResponse(
            id=request_id, created=created, model=model, choices=[], usage=total
        ).model_dump_json()


class _ChatFormat(_Format):
    def __init__(self, engine: AsyncEngine, top_logprobs: int | None) -> None:
        super().__init__(engine)
        self.top_logprobs = top_logprobs
        self.has_logprobs = top_logprobs is not None
        self.started: set[int] = set()

    def _lp(self, c: CompletionOutput) -> ChatLogprobs | None:
        return None if self.top_logprobs is None else chat_logprobs(c, self.engine, self.top_logprobs)

    def full(self, request_id: str, created: int, model: str, finals: list, n: int) -> ChatCompletionResponse:
        out = finals[0]
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=self._lp(c),
                finish_reason=c.finish_reason,
            )
            for c in out.outputs
        ]
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)),
        )

    def chunk(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> str:
        delta = {"content": c.text}
        if index not in self.started:  # the first chunk of a choice names the role
            self.started.add(index)
            delta = {"role": "assistant", "content": c.text}
        choice = ChatStreamChoice(
            index=index, delta=delta, logprobs=self._lp(c), finish_reason=c.finish_reason
        )
        return ChatCompletionChunk(
            id=request_id, created=created, model=model, choices=[choice]
        ).model_dump_json()

    def usage_chunk(self, request_id: str, created: int, model: str, total: Any) -> str:
        return ChatCompletionChunk(
            id=request_id, created=created, model=model, choices=[], usage=total
        ).model_dump_json()
