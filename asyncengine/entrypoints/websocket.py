"""The /v1/ws handler: one websocket multiplexes many generate requests as JSON text frames.

client -> server  {"type": "generate", "request_id": "r1", "prompt": "..." | "prompt_token_ids": [...]
                   | "messages": [{"role": "user", "content": "..."}, ...], "params": {SamplingParams fields}}
                  {"type": "cancel", "request_id": "r1"}
server -> client  {"type": "delta", "request_id": "r1", "text": "...", "token_ids": [...], "logprobs"?: [...]}
                  {"type": "done", "request_id": "r1", "finish_reason": "stop" | "length" | "abort",
                   "usage": {"prompt_tokens": N, "completion_tokens": M}}
                  {"type": "error", "request_id": "r1" | null, "code": 400 | 413 | 429 | 500 | 503,
                   "message": "..."}

A generate frame carries exactly one of `prompt`, `prompt_token_ids` and `messages`. `messages` is a chat,
a non-empty list of objects with exactly the string fields `role` and `content` (and the frame may add
`"add_generation_prompt": false`; true by default); it is rendered through the model's chat template as
/v1/chat/completions renders its messages (render_chat, in a thread). An invalid one gets a 400 error
frame naming the field (`param`).

Authentication: an `Authorization: Bearer KEY` header, or (for browsers, which cannot set headers on a
WebSocket) the subprotocols `asyncengine` and `asyncengine.bearer.KEY` offered together; the server then
answers with the `asyncengine` subprotocol (guard.py checks the key before the handshake is accepted).

Each request runs in its own task and puts frames on the connection's outbox; one writer task sends
them, so frames never interleave. A request id stays taken until its `done` or `error` frame.

A client that does not read its output (ServerLimits.max_unsent_bytes queued, or one frame waiting
send_stall_timeout seconds to be sent) has all its requests aborted and the connection closed with 1008
"client is not reading its output".
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from fastapi import WebSocket

from asyncengine.engine import AsyncEngine, Prompt
from asyncengine.entrypoints.api_errors import (
    ApiError,
    PayloadTooLargeError,
    TooManyRequestsError,
    message_of,
    param_of,
    status_of,
)
from asyncengine.entrypoints.guard import WS_PROTOCOL
from asyncengine.entrypoints.openai_protocol import ChatMessage, ChatTemplateFields
from asyncengine.entrypoints.outbox import CLOSE_GRACE_S, NOT_READING, Outbox
from asyncengine.entrypoints.prompts import render_chat
from asyncengine.entrypoints.server_state import ServerState
from asyncengine.entrypoints.streams import clamp
from asyncengine.outputs import CompletionOutput
from asyncengine.sampling_params import OutputKind, SamplingParams

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 256
NOT_READING_CODE = 1008  # policy violation: the client does not take what it asked for


@dataclass
class LiveRequest:
    engine_id: str
    task: asyncio.Task | None = None
    cancelled: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def websocket_endpoint(websocket: WebSocket) -> None:
    # a browser that offered subprotocols fails the connection unless the server picks one of them
    offered = websocket.scope.get("subprotocols") or []
    await websocket.accept(subprotocol=WS_PROTOCOL if WS_PROTOCOL in offered else None)
    await Connection(websocket, websocket.app.state.server).run()


class Connection:
    def __init__(self, ws: WebSocket, state: ServerState) -> None:
        self.ws = ws
        self.state = state
        self.id = uuid.uuid4().hex[:12]
        self.outbox = Outbox[str](state.limits, ws.send_text, "frame")  # one writer task sends it
        self.live: dict[str, LiveRequest] = {}

    @property
    def unsent(self) -> int:
        """Bytes queued for the client, the frame being sent included."""
        return self.outbox.unsent

    @property
    def stopped(self) -> str | None:
        """Why the client counts as not reading (None while it reads)."""
        return self.outbox.stopped

    async def run(self) -> None:
        writer = self.outbox.sender = asyncio.create_task(self._write(), name=f"ws-writer-{self.id}")
        reader = asyncio.create_task(self._read(), name=f"ws-reader-{self.id}")
        try:
            # returns when the client disconnects, the writer stops, or the client is found not reading
            await self.outbox.wait({reader, writer})
        finally:
            # the client is gone or not reading: abort everything it started (cancelling a task aborts its
            # request, which frees its batch slot and KV blocks at once)
            reader.cancel()
            writer.cancel()
            tasks = [r.task for r in self.live.values() if r.task is not None]
            for t in tasks:
                t.cancel()
            # NOTE: shielded: when the server cancels this task (a disconnect under anyio, say), the
            # cancellations above still run to the end
            with anyio.CancelScope(shield=True):
                await asyncio.gather(reader, writer, *tasks, return_exceptions=True)
        if self.stopped is not None:
            await self._close_not_reading(len(tasks))

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            await self._on_frame(message.get("text"), message.get("bytes"))

    async def _write(self) -> None:
        try:
            await self.outbox.send_all()  # never closed: runs until cancelled or the socket fails
        except Exception:  # the socket closed under us: run() cleans up
            logger.debug("websocket %s: writer stopped", self.id, exc_info=True)

    def send(self, frame: dict[str, Any]) -> None:
        if self.stopped is not None:
            return  # closing: the client was not reading (and dumping the frame would be wasted)
        text = json.dumps(frame, separators=(",", ":"))
        self.outbox.put(text, len(text))  # len is the byte count: json.dumps escapes non-ASCII

    async def _close_not_reading(self, aborted: int) -> None:
        logger.info(
            "websocket %s: %s (%s): aborted its %d requests, closing it",
            self.id,
            NOT_READING,
            self.stopped,
            aborted,
        )
        try:
            # NOTE: uvicorn writes nothing, the close frame included, until the client drains some of what it
            # has not read; past the grace uvicorn closes the socket (after the kernel flushes the rest)
            await asyncio.wait_for(self.ws.close(NOT_READING_CODE, NOT_READING), CLOSE_GRACE_S)
        except Exception:
            logger.debug("websocket %s: no close frame sent", self.id, exc_info=True)

    def send_error(self, request_id: str | None, exc: BaseException) -> None:
        if status_of(exc) == 500:
            logger.error("websocket request %s failed", request_id, exc_info=exc)
        frame = {
            "type": "error",
            "request_id": request_id,
            "code": status_of(exc),
            "message": message_of(exc),
        }
        if (param := param_of(exc)) is not None:
            frame["param"] = param  # the offending field, as in OpenAI's error bodies
        self.send(frame)

    # -- incoming frames --------------------------------------------------------------------------
    async def _on_frame(self, text: str | None, data: bytes | None) -> None:
        request_id = None
        try:
            if text is None:
                raise ApiError("send JSON text frames, not binary ones")
            if len(text) > self.state.limits.max_frame_bytes:
                raise PayloadTooLargeError(f"frame over {self.state.limits.max_frame_bytes} bytes")
            try:
                frame = json.loads(text)
            except ValueError:
                raise ApiError("the frame is not valid JSON") from None
            if not isinstance(frame, dict):
                raise ApiError("a frame must be a JSON object")
            request_id = frame.get("request_id")
            if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
                request_id = None
                raise ApiError(f"request_id must be a string of 1..{MAX_REQUEST_ID_LEN} characters")
            kind = frame.get("type")
            if kind == "generate":
                self._start(request_id, frame)
            elif kind == "cancel":
                await self._cancel(request_id)
            else:
                raise ApiError(f"unknown frame type {kind!r}: expected 'generate' or 'cancel'")
        except Exception as e:
            self.send_error(request_id, e)

    def _start(self, request_id: str, frame: dict[str, Any]) -> None:
        if request_id in self.live:
            raise ApiError(f"request id {request_id!r} is already live on this connection")
        if len(self.live) >= self.state.limits.max_live_per_connection:
            raise TooManyRequestsError(
                f"this connection has {len(self.live)} live requests "
                f"(limit {self.state.limits.max_live_per_connection})"
            )
        prompt = parse_prompt(frame)
        raw = frame.get("params", {})
        if not isinstance(raw, dict):
            raise ApiError("params must be a JSON object")
        params = SamplingParams.from_dict(raw)
        if params.n != 1:
            raise ApiError("the websocket streams one sequence per request: send n requests instead of n > 1")
        params = msgspec.structs.replace(params, output_kind=OutputKind.DELTA)
        engine = self.state.require_engine()
        self.state.acquire()
        live = LiveRequest(f"ws-{self.id}-{request_id}")
        self.live[request_id] = live
        live.task = asyncio.create_task(self._stream(request_id, live, engine, prompt, params))

        def finished(_: asyncio.Task) -> None:  # runs even if the task was cancelled before it started
            self.live.pop(request_id, None)
            self.state.release()

        live.task.add_done_callback(finished)

    async def _cancel(self, request_id: str) -> None:
        live = self.live.get(request_id)
        if live is None:
            raise ApiError(f"no live request {request_id!r} on this connection")
        live.cancelled = True  # covers a task that has not reached the engine yet
        engine = self.state.engine
        if engine is not None:
            await engine.abort(live.engine_id)  # the stream then ends with finish_reason "abort"

    # -- one request ------------------------------------------------------------------------------
    async def _stream(
        self,
        request_id: str,
        live: LiveRequest,
        engine: AsyncEngine,
        prompt: Prompt | ChatTemplateFields,
        params: SamplingParams,
    ) -> None:
        finish_reason = "abort"
        try:
            if isinstance(prompt, ChatTemplateFields):  # the template can be slow: off the event loop
                prompt = await asyncio.to_thread(render_chat, engine, prompt)
            if not live.cancelled:
                async for out in engine.generate(prompt, params, live.engine_id):
                    c = out.outputs[0]
                    live.prompt_tokens = len(out.prompt_token_ids)
                    if c.text or c.token_ids:
                        live.completion_tokens += len(c.token_ids)
                        self.send(delta_frame(request_id, c))
                    finish_reason = c.finish_reason or finish_reason
        except Exception as e:
            self.send_error(request_id, e)
            return
        self.send(
            {
                "type": "done",
                "request_id": request_id,
                "finish_reason": finish_reason,
                "usage": {"prompt_tokens": live.prompt_tokens, "completion_tokens": live.completion_tokens},
            }
        )


def parse_prompt(frame: dict[str, Any]) -> Prompt | ChatTemplateFields:
    prompt, ids, messages = frame.get("prompt"), frame.get("prompt_token_ids"), frame.get("messages")
    if sum(x is not None for x in (prompt, ids, messages)) != 1:
        raise ApiError("send exactly one of prompt, prompt_token_ids and messages")
    if messages is not None:
        return parse_messages(messages, frame.get("add_generation_prompt", True))
    if "add_generation_prompt" in frame:
        raise ApiError("add_generation_prompt goes with messages", param="add_generation_prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ApiError("prompt must be a string")
        return prompt
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError("prompt_token_ids must be a list of integers")
    return ids


def parse_messages(messages: Any, add_generation_prompt: Any) -> ChatTemplateFields:
    """A chat, checked strictly: a non-empty list of {"role": str, "content": str}, nothing else."""
    if not isinstance(messages, list) or not messages:
        raise ApiError('messages must be a non-empty list of {"role", "content"} objects', param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ApiError(
                f"messages[{i}] must be an object with exactly the fields role and content", param="messages"
            )
        if not isinstance(m["role"], str) or not m["role"]:
            raise ApiError(f"messages[{i}].role must be a non-empty string", param="messages")
        if not isinstance(m["content"], str):
            raise ApiError(f"messages[{i}].content must be a string", param="messages")
    if not isinstance(add_generation_prompt, bool):
        raise ApiError("add_generation_prompt must be true or false", param="add_generation_prompt")
    return ChatTemplateFields(
        messages=[ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        add_generation_prompt=add_generation_prompt,
    )


def delta_frame(request_id: str, c: CompletionOutput) -> dict[str, Any]:
    frame: dict[str, Any] = {
        "type": "delta",
        "request_id": request_id,
        "text": c.text,
        "token_ids": c.token_ids,
    }
    if c.logprobs is not None:
        # per generated token: candidates, the sampled token first
        frame["logprobs"] = [
            [
                {"token_id": t, "logprob": clamp(lp.logprob), "rank": lp.rank, "token": lp.decoded_token}
                for t, lp in table.items()
            ]
            for table in c.logprobs
        ]
    return frame
