"""Helpers for HTTP generation: start engine streams so bad input is a 400 before any byte is sent,
merge several streams, server-sent events that always release their requests and drop a client that does
not read, disconnect watching.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from asyncengine.engine import AsyncEngine, Prompt
from asyncengine.entrypoints.api_errors import error_body
from asyncengine.entrypoints.outbox import CLOSE_GRACE_S, NOT_READING, Outbox
from asyncengine.entrypoints.server_state import ServerLimits
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
MIN_LOGPROB = -9999.0  # -inf is not JSON; vLLM clamps the same way


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


async def _prepend(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    try:
        yield first
        if not first.finished:
            async for out in rest:
                yield out
    finally:
        await rest.aclose()  # type: ignore[attr-defined]  # aborts the request when left early


async def open_streams(
    engine: AsyncEngine, prompts: list[Prompt], params: SamplingParams, request_id: str
) -> list[AsyncIterator[RequestOutput]]:
    """Adds every prompt and waits for its first output, so validation errors raise here, not mid-stream."""
    gens = [engine.generate(p, params, f"{request_id}-{i}") for i, p in enumerate(prompts)]
    tasks = [asyncio.ensure_future(anext(g)) for g in gens]
    try:
        firsts = await asyncio.gather(*tasks)
    except BaseException:
        # cancelling a pending first output aborts that request; then every generator is closed
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
        raise
    return [_prepend(f, g) for f, g in zip(firsts, gens)]


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) from all streams as items arrive; leaving early closes every stream."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except Exception as e:
            await queue.put((i, done, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                left -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None  # generate always ends with a finished output
    return last


async def generate_all(
    engine: AsyncEngine, prompts: list[Prompt], params: SamplingParams, request_id: str
) -> list[RequestOutput]:
    """The final output of every prompt, in order; one failure (or a cancel) aborts all the others."""
    tasks = [
        asyncio.ensure_future(collect(engine.generate(p, params, f"{request_id}-{i}")))
        for i, p in enumerate(prompts)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`, cancelling it (which aborts its requests) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected("client disconnected")
    return task.result()


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed, even when the client disconnects mid-send.

    A pump task pulls the generator into an outbox that a sender task empties, so output the client has not
    taken is counted (pulled by send() instead, it would pile up unseen in the engine's request queues).
    Over `limits.max_unsent_bytes`, or when one send waits `limits.send_stall_timeout` seconds (uvicorn's
    send waits while the socket's buffers are full), the generator is closed, aborting its requests, and the
    response ends with an in-band error, if the client takes it within CLOSE_GRACE_S.
    """

    def __init__(
        self, content: AsyncIterator[str], limits: ServerLimits | None = None, name: str = ""
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.limits = limits or ServerLimits()
        self.name = name  # for the log
        self.outbox: Outbox[Message] | None = None  # made by stream_response, which has the send
        self.started = False  # the status line and headers went out

    @property
    def stopped(self) -> str | None:
        """Why the client counts as not reading (None while it reads, or before the response starts)."""
        return None if self.outbox is None else self.outbox.stopped

    async def stream_response(self, send: Send) -> None:
        outbox = self.outbox = Outbox[Message](self.limits, send, "chunk")
        pump = asyncio.create_task(self._pump(outbox))
        sender = outbox.sender = asyncio.create_task(self._send_all(outbox))
        try:
            await self._watch(outbox, sender, pump)
            for task in (pump, sender):  # a failed send (the client went away) or generator
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            # NOTE: shielded: a disconnect cancels this scope, and the generator's cleanup aborts requests;
            # cancelling the pump throws into the generator in a task no scope cancels again mid-cleanup
            with anyio.CancelScope(shield=True):
                sender.cancel()
                pump.cancel()
                await asyncio.gather(sender, pump, return_exceptions=True)
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if outbox.stopped is not None:
            await self._end_not_reading(send)

    async def _pump(self, outbox: Outbox[Message]) -> None:
        async for chunk in self.body_iterator:
            data = chunk.encode(self.charset) if isinstance(chunk, str) else bytes(chunk)
            outbox.put({"type": "http.response.body", "body": data, "more_body": True}, len(data))
            if outbox.stopped is not None:
                return
        outbox.close()

    async def _send_all(self, outbox: Outbox[Message]) -> None:
        await outbox.send(self._start_message())
        self.started = True
        await outbox.send_all()
        await outbox.send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _watch(outbox: Outbox[Message], sender: asyncio.Task, pump: asyncio.Task) -> None:
        """Returns when the response is sent, a task failed, or the client is not reading."""
        waiting = {sender, pump}
        while done := await outbox.wait(waiting):
            if sender in done or (pump in done and (pump.cancelled() or pump.exception() is not None)):
                return
            waiting -= done  # the generator ended: wait for the sender to send the rest

    async def _end_not_reading(self, send: Send) -> None:
        logger.info(
            "SSE response %s: %s (%s): aborted its requests, ending it", self.name, NOT_READING, self.stopped
        )
        end = sse(json.dumps(error_body(NOT_READING, 408))) + "data: [DONE]\n\n"
        try:
            # NOTE: uvicorn writes nothing until the client drains some of what it has not read; past the
            # grace the response stays incomplete and uvicorn closes the connection (after the kernel flushes)
            await asyncio.wait_for(self._send_end(send, end.encode()), CLOSE_GRACE_S)
        except Exception:
            logger.debug("SSE response %s: not ended", self.name, exc_info=True)

    async def _send_end(self, send: Send, body: bytes) -> None:
        if not self.started:  # the headers' send stalled (the connection's previous response is unread)
            await send(self._start_message())
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _start_message(self) -> Message:
        return {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
