"""The /v1/ws handler: one websocket multiplexes many generate requests as JSON text frames.

client -> server  {"type": "generate", "request_id": "r1", "prompt": "..." | "prompt_token_ids": [...],
                   "params": {SamplingParams fields}}
                  {"type": "cancel", "request_id": "r1"}
server -> client  {"type": "delta", "request_id": "r1", "text": "...", "token_ids": [...], "logprobs"?: [...]}
                  {"type": "done", "request_id": "r1", "finish_reason": "stop" | "length" | "abort",
                   "usage": {"prompt_tokens": N, "completion_tokens": M}}
                  {"type": "error", "request_id": "r1" | null, "code": 400 | 413 | 429 | 500 | 503, "message": "..."}

Each request runs in its own task and puts frames on the connection's outbox; one writer task sends
them, so frames never interleave. A request id stays taken until its `done` or `error` frame.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import WebSocket

from asyncengine.engine import AsyncEngine, Prompt
from asyncengine.entrypoints.api_errors import (
    ApiError,
    PayloadTooLargeError,
    TooManyRequestsError,
    message_of,
    status_of,
)
from asyncengine.entrypoints.server import ServerState
from asyncengine.entrypoints.streams import clamp
from asyncengine.outputs import CompletionOutput
from asyncengine.sampling_params import OutputKind, SamplingParams

logger = logging.getLogger(__name__)

OUTBOX_FRAMES = 4096  # per connection; a slow reader stalls its own request tasks, not the engine loop
MAX_REQUEST_ID_LEN = 256


@dataclass
class LiveRequest:
    engine_id: str
    task: asyncio.Task | None = None
    cancelled: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def websocket_endpoint(websocket: WebSocket) -> None:
    await websocket.accept()
    await Connection(websocket, websocket.app.state.server).run()


class Connection:
    def __init__(self, ws: WebSocket, state: ServerState) -> None:
        self.ws = ws
        self.state = state
        self.id = uuid.uuid4().hex[:12]
        self.outbox: asyncio.Queue[str] = asyncio.Queue(OUTBOX_FRAMES)
        self.live: dict[str, LiveRequest] = {}

    async def run(self) -> None:
        writer = asyncio.create_task(self._write(), name=f"ws-writer-{self.id}")
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                await self._on_frame(message.get("text"), message.get("bytes"))
        finally:
            # the client is gone: abort everything it started (cancelling a task aborts its request)
            tasks = [r.task for r in self.live.values() if r.task is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _write(self) -> None:
        try:
            while True:
                await self.ws.send_text(await self.outbox.get())
        except Exception:  # the socket closed under us; the reader sees the disconnect and cleans up
            logger.debug("websocket %s: writer stopped", self.id, exc_info=True)

    async def send(self, frame: dict[str, Any]) -> None:
        await self.outbox.put(json.dumps(frame, separators=(",", ":")))

    async def send_error(self, request_id: str | None, exc: BaseException) -> None:
        if status_of(exc) == 500:
            logger.error("websocket request %s failed", request_id, exc_info=exc)
        await self.send({"type": "error", "request_id": request_id, "code": status_of(exc),
                         "message": message_of(exc)})

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
            await self.send_error(request_id, e)

    def _start(self, request_id: str, frame: dict[str, Any]) -> None:
        if request_id in self.live:
            raise ApiError(f"request id {request_id!r} is already live on this connection")
        if len(self.live) >= self.state.limits.max_live_per_connection:
            raise TooManyRequestsError(f"this connection has {len(self.live)} live requests "
                                       f"(limit {self.state.limits.max_live_per_connection})")
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
    async def _stream(self, request_id: str, live: LiveRequest, engine: AsyncEngine, prompt: Prompt,
                      params: SamplingParams) -> None:
        finish_reason = "abort"
        try:
            if not live.cancelled:
                async for out in engine.generate(prompt, params, live.engine_id):
                    c = out.outputs[0]
                    live.prompt_tokens = len(out.prompt_token_ids)
                    if c.text or c.token_ids:
                        live.completion_tokens += len(c.token_ids)
                        await self.send(delta_frame(request_id, c))
                    finish_reason = c.finish_reason or finish_reason
        except Exception as e:
            await self.send_error(request_id, e)
            return
        await self.send({"type": "done", "request_id": request_id, "finish_reason": finish_reason,
                         "usage": {"prompt_tokens": live.prompt_tokens,
                                   "completion_tokens": live.completion_tokens}})


def parse_prompt(frame: dict[str, Any]) -> Prompt:
    prompt, ids = frame.get("prompt"), frame.get("prompt_token_ids")
    if (prompt is None) == (ids is None):
        raise ApiError("send exactly one of prompt and prompt_token_ids")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ApiError("prompt must be a string")
        return prompt
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError("prompt_token_ids must be a list of integers")
    return ids


def delta_frame(request_id: str, c: CompletionOutput) -> dict[str, Any]:
    frame: dict[str, Any] = {"type": "delta", "request_id": request_id, "text": c.text, "token_ids": c.token_ids}
    if c.logprobs is not None:
        # per generated token: candidates, the sampled token first
        frame["logprobs"] = [[{"token_id": t, "logprob": clamp(lp.logprob), "rank": lp.rank,
                               "token": lp.decoded_token} for t, lp in table.items()] for table in c.logprobs]
    return frame
