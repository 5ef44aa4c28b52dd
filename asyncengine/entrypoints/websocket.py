"""The /v1/ws handler: one websocket multiplexes many generate requests as JSON text frames.

client -> server  {"type": "generate", "request_id": "r1", "prompt": "..." | "prompt_token_ids": [...]
                   | "messages": [{"role": "user", "content": "..."}, ...], "params": {SamplingParams fields},
                   with messages optionally "add_generation_prompt", "tools", "tool_choice",
                   "parallel_tool_calls"}
                  {"type": "cancel", "request_id": "r1"}
server -> client  {"type": "delta", "request_id": "r1", "text": "...", "token_ids": [...], "logprobs"?: [...],
                   "tool_calls"?: [...]}
                  {"type": "done", "request_id": "r1", "finish_reason": "stop" | "length" | "abort"
                   | "tool_calls", "usage": {"prompt_tokens": N, "completion_tokens": M},
                   "tool_calls"?: [...]}
                  {"type": "error", "request_id": "r1" | null, "code": 400 | 413 | 429 | 500 | 503,
                   "message": "...", "param"?: "..."}

A generate frame carries exactly one of `prompt`, `prompt_token_ids` and `messages`. `messages` is a chat,
a non-empty list of objects with the string fields `role` and `content` (and optionally `name`, an
assistant's earlier `tool_calls` with content null, a tool message's `tool_call_id`); the frame may add
`"add_generation_prompt": false` (true by default), and `tools`, `tool_choice`, `parallel_tool_calls` as
/v1/chat/completions takes them. It is rendered through the model's chat template as that route renders
its messages (render_chat, in a thread). An invalid one gets a 400 error frame naming the field (`param`).

`params.structured_outputs` constrains the output as the HTTP routes' field does: exactly one of
{"json": schema, "regex": "...", "choice": [...], "grammar": "...", "json_object": true} (and
"disable_any_whitespace", "whitespace_pattern" for JSON). A chat with tools streams its calls as
OpenAI's deltas (`tool_calls` in delta frames, `text` then only the content; all calls in the done
frame, finish_reason "tool_calls"): ws_chat.py.

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
from asyncengine.entrypoints.chat_protocol import ChatToolFields
from asyncengine.entrypoints.chat_tools import tool_calling
from asyncengine.entrypoints.guard import WS_PROTOCOL
from asyncengine.entrypoints.outbox import CLOSE_GRACE_S, NOT_READING, Outbox
from asyncengine.entrypoints.prompts import render_chat
from asyncengine.entrypoints.server_state import ServerState
from asyncengine.entrypoints.streams import clamp
from asyncengine.entrypoints.ws_chat import CHAT_FIELDS, ToolCallFrames, parse_chat
from asyncengine.outputs import CompletionOutput
from asyncengine.sampling_params import OutputKind, SamplingParams
from asyncengine.structured_output import structured_outputs_from_request

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
        # checking a constraint compiles it, which takes a while for a large one: that frame is read in its
        # task, off the loop (its errors come the same way, as an error frame); any other one here
        request = None if constrained(frame) else parse_request(frame)
        engine = self.state.require_engine()
        self.state.acquire()
        live = LiveRequest(f"ws-{self.id}-{request_id}")
        self.live[request_id] = live
        live.task = asyncio.create_task(self._stream(request_id, live, engine, frame, request))

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
        frame: dict[str, Any],
        request: tuple[Prompt | ChatToolFields, SamplingParams] | None,
    ) -> None:
        finish_reason = "abort"
        calls = None
        try:
            prompt, params = request or await asyncio.to_thread(parse_request, frame)
            if isinstance(prompt, ChatToolFields):
                tools = tool_calling(
                    prompt, getattr(engine.tokenizer, "chat_template", None), self.state.tool_call_parser
                )
                calls = ToolCallFrames(tools) if tools is not None else None
                prompt = await asyncio.to_thread(render_chat, engine, prompt)  # slow on long chats
            if not live.cancelled:
                async for out in engine.generate(prompt, params, live.engine_id):
                    c = out.outputs[0]
                    live.prompt_tokens = len(out.prompt_token_ids)
                    delta = delta_frame(request_id, c)
                    if calls is not None:
                        delta.update(calls.fields(c.text, c.finish_reason is not None))
                    if c.text or c.token_ids or "tool_calls" in delta:
                        live.completion_tokens += len(c.token_ids)
                        self.send(delta)
                    finish_reason = c.finish_reason or finish_reason
        except Exception as e:
            self.send_error(request_id, e)
            return
        done: dict[str, Any] = {
            "type": "done",
            "request_id": request_id,
            "finish_reason": finish_reason if calls is None else calls.finish_reason(finish_reason),
            "usage": {"prompt_tokens": live.prompt_tokens, "completion_tokens": live.completion_tokens},
        }
        if calls is not None and calls.calls:
            done["tool_calls"] = calls.calls
        self.send(done)


def parse_prompt(frame: dict[str, Any]) -> Prompt | ChatToolFields:
    prompt, ids, messages = frame.get("prompt"), frame.get("prompt_token_ids"), frame.get("messages")
    if sum(x is not None for x in (prompt, ids, messages)) != 1:
        raise ApiError("send exactly one of prompt, prompt_token_ids and messages")
    if messages is not None:
        return parse_chat(frame)
    for key in CHAT_FIELDS:
        if key in frame:
            raise ApiError(f"{key} goes with messages", param=key)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ApiError("prompt must be a string")
        return prompt
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError("prompt_token_ids must be a list of integers")
    return ids


def constrained(frame: dict[str, Any]) -> bool:
    """Whether a generate frame may carry a constraint (structured_outputs, or tools to force)."""
    params = frame.get("params")
    structured = isinstance(params, dict) and params.get("structured_outputs") is not None
    return structured or bool(frame.get("tools"))


def parse_request(frame: dict[str, Any]) -> tuple[Prompt | ChatToolFields, SamplingParams]:
    """A generate frame's prompt (or chat) and params; a 400 naming the field for anything malformed."""
    prompt = parse_prompt(frame)
    params = parse_params(frame.get("params", {}))
    if params.n != 1:
        raise ApiError("the websocket streams one sequence per request: send n requests instead of n > 1")
    params = msgspec.structs.replace(params, output_kind=OutputKind.DELTA)
    if isinstance(prompt, ChatToolFields):
        forced = prompt.tool_structured_outputs()
        if forced is not None:
            if params.structured_outputs is not None:
                raise ApiError(
                    "tool_choice 'required' or a named tool constrains the output to the call: it cannot "
                    "be combined with params.structured_outputs",
                    param="tool_choice",
                )
            params = msgspec.structs.replace(params, structured_outputs=forced)
    return prompt, params


def parse_params(raw: Any) -> SamplingParams:
    """The frame's `params`; its structured_outputs checked first, so an error names the part to blame
    (SamplingParams.from_dict's own errors name no field below the top level)."""
    if not isinstance(raw, dict):
        raise ApiError("params must be a JSON object")
    if raw.get("structured_outputs") is None:
        return SamplingParams.from_dict(raw)
    structured = structured_outputs_from_request(raw["structured_outputs"])
    params = SamplingParams.from_dict({k: v for k, v in raw.items() if k != "structured_outputs"})
    return msgspec.structs.replace(params, structured_outputs=structured)


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
