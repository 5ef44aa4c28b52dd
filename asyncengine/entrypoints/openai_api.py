"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from asyncengine.engine import AsyncEngine, Prompt
from asyncengine.entrypoints.api_errors import ApiError, error_body, message_of, status_of
from asyncengine.entrypoints.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TokenLogprob,
    TopLogprob,
    usage,
)
from asyncengine.entrypoints.server import ServerState
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

router = APIRouter()
STARTED = int(time.time())


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _check_model(state: ServerState, engine: AsyncEngine, model: str | None) -> str:
    if model not in (None, "", state.model_name, engine.config.model):
        raise ApiError(f"the model {model!r} does not exist; this server serves {state.model_name!r}", 404)
    return state.model_name


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = _state(request)
    engine = state.require_engine()
    card = {"id": state.model_name, "object": "model", "created": STARTED, "owned_by": "asyncengine",
            "root": engine.config.model, "max_model_len": engine.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


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
        content.append(TokenLogprob(
            token=text, logprob=clamp(sampled.logprob) if sampled else MIN_LOGPROB, bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=(s := _token_text(t, lp, engine)), logprob=clamp(lp.logprob),
                                     bytes=list(s.encode())) for t, lp in top]))
    return ChatLogprobs(content=content)



# -- /v1/completions --------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = _state(request)
    req = CompletionRequest.model_validate_json(await request.body())
    engine = state.require_engine()
    model = _check_model(state, engine, req.model)
    params = req.sampling_params()
    prompts = req.prompts()
    return await _serve(request, state, engine, prompts, params, f"cmpl-{uuid.uuid4().hex}", model,
                        req.include_usage, _CompletionFormat(engine, req.logprobs is not None, req.return_token_ids))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    req = ChatCompletionRequest.model_validate_json(await request.body())
    engine = state.require_engine()
    model = _check_model(state, engine, req.model)
    params = req.sampling_params()
    prompt = render_chat(engine, req)
    fmt = _ChatFormat(engine, req.top_logprobs or 0 if req.logprobs else None)
    return await _serve(request, state, engine, [prompt], params, f"chatcmpl-{uuid.uuid4().hex}", model,
                        req.include_usage, fmt)


def render_chat(engine: AsyncEngine, req: ChatCompletionRequest) -> list[int]:
    """The prompt token ids from the tokenizer's chat template."""
    tok = engine.tokenizer
    if tok is None:
        raise ApiError("this model has no tokenizer, so chat is unavailable: use /v1/completions with token ids")
    if not getattr(tok, "chat_template", None):
        raise ApiError("this model's tokenizer has no chat template: use /v1/completions")
    messages = [m.as_template_input() for m in req.messages]
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, tokenize=False)
    except Exception as e:  # jinja raises anything (templates call raise_exception on bad roles)
        raise ApiError(f"cannot apply the chat template: {e}") from None
    # NOTE: the template already wrote any BOS; encoding with special tokens would add a second one
    return tok.encode(text, add_special_tokens=False)


async def _serve(request: Request, state: ServerState, engine: AsyncEngine, prompts: list[Prompt],
                 params: SamplingParams, request_id: str, model: str, include_usage: bool,
                 fmt: _Format) -> Response:
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
    return SSEResponse(_events(state, slots, streams, request_id, created, model, params.n, include_usage, fmt))


async def _events(state: ServerState, slots: int, streams: list, request_id: str, created: int, model: str,
                  n: int, include_usage: bool, fmt: _Format) -> AsyncIterator[str]:
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
        yield sse(json.dumps(error_body(message_of(e), status_of(e))))
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
        choices = [CompletionChoice(index=i * n + c.index, text=c.text, logprobs=self._lp(i * n + c.index, c),
                                    finish_reason=c.finish_reason, token_ids=list(c.token_ids) if ids else None,
                                    prompt_token_ids=list(out.prompt_token_ids) if ids else None)
                   for i, out in enumerate(finals) for c in out.outputs]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens))

    def chunk(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> str:
        choice = CompletionChoice(index=index, text=c.text, logprobs=self._lp(index, c),
                                  finish_reason=c.finish_reason, token_ids=list(c.token_ids) if self.token_ids else None)
        return CompletionResponse(id=request_id, created=created, model=model,
                                  choices=[choice]).model_dump_json()

    def usage_chunk(self, request_id: str, created: int, model: str, total: Any) -> str:
        return CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                  usage=total).model_dump_json()


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
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=self._lp(c),
                              finish_reason=c.finish_reason) for c in out.outputs]
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=usage(len(out.prompt_token_ids),
                                                  sum(len(c.token_ids) for c in out.outputs)))

    def chunk(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> str:
        delta = {"content": c.text}
        if index not in self.started:  # the first chunk of a choice names the role
            self.started.add(index)
            delta = {"role": "assistant", "content": c.text}
        choice = ChatStreamChoice(index=index, delta=delta, logprobs=self._lp(c), finish_reason=c.finish_reason)
        return ChatCompletionChunk(id=request_id, created=created, model=model,
                                   choices=[choice]).model_dump_json()

    def usage_chunk(self, request_id: str, created: int, model: str, total: Any) -> str:
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                   usage=total).model_dump_json()
