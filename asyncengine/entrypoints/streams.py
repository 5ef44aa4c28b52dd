"""Helpers for HTTP generation: start engine streams so bad input is a 400 before any byte is sent,
merge several streams, server-sent events that always release their requests, disconnect watching.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Send

from asyncengine.engine import AsyncEngine, Prompt
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams

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


async def open_streams(engine: AsyncEngine, prompts: list[Prompt], params: SamplingParams,
                       request_id: str) -> list[AsyncIterator[RequestOutput]]:
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


async def generate_all(engine: AsyncEngine, prompts: list[Prompt], params: SamplingParams,
                       request_id: str) -> list[RequestOutput]:
    """The final output of every prompt, in order; one failure (or a cancel) aborts all the others."""
    tasks = [asyncio.ensure_future(collect(engine.generate(p, params, f"{request_id}-{i}")))
             for i, p in enumerate(prompts)]
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
    """Server-sent events whose generator is always closed, even when the client disconnects mid-send."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            # NOTE: shielded: a disconnect cancels this scope, and the generator's cleanup aborts requests
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
