"""Output queued for one client that may not be reading it: a websocket connection's frames, or one SSE
response's chunks.

Putting never waits, so a request always keeps taking its engine output (a put that waited would leave
the output to pile up in the engine's request queues, unseen); instead the queue is bounded in bytes, and
a send (uvicorn's send waits while the socket's buffers are full) in time. Past either bound the outbox
stops: its unsent output is dropped, and its owner aborts the client's requests and ends the connection.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from asyncengine.entrypoints.server_state import ServerLimits

T = TypeVar("T")
NOT_READING = "client is not reading its output"
# for a client found not reading to take the end of its response (websocket: the close frame)
CLOSE_GRACE_S = 10.0


def stall_check_interval(timeout: float) -> float | None:
    """How often to look for a send stalled past `timeout` seconds (None: never, 0 turns the check off)."""
    return min(1.0, timeout / 4) if timeout > 0 else None


class Outbox(Generic[T]):
    """Items (frames, chunks) for `deliver`, sent in order by `send_all`, which runs as its own task."""

    def __init__(self, limits: ServerLimits, deliver: Callable[[T], Awaitable[None]], unit: str) -> None:
        self.limits = limits
        self.deliver = deliver
        self.unit = unit  # "frame", "chunk": for the reason a client is stopped
        self.items: deque[tuple[T, int]] = deque()  # (item, its bytes)
        self.unsent = 0  # bytes queued, the item being sent included
        self.wake = asyncio.Event()  # an item was put, or the outbox was closed
        self.closed = False  # no more items will be put: send_all returns once the rest is sent
        self.sending_since: float | None = None  # loop time the current send began
        self.stopped: str | None = None  # why the client counts as not reading; set once
        self.sender: asyncio.Task | None = None  # the owner's task running send_all: stop cancels it

    def put(self, item: T, size: int) -> None:
        if self.stopped is not None:
            return  # stopping: the client was not reading
        self.items.append((item, size))
        self.unsent += size
        self.wake.set()
        limit = self.limits.max_unsent_bytes
        if self.unsent > limit:
            self.stop(f"{self.unsent} bytes unsent, over the {limit} byte limit")

    def close(self) -> None:
        self.closed = True
        self.wake.set()

    async def send_all(self) -> None:
        while self.items or not self.closed:
            if not self.items:
                self.wake.clear()
                await self.wake.wait()
                continue
            item, size = self.items[0]
            await self.send(item)
            self.items.popleft()
            self.unsent -= size

    async def send(self, item: T) -> None:
        """Delivers one item now, timed by the stall check (also for what goes around the queue)."""
        self.sending_since = asyncio.get_running_loop().time()
        await self.deliver(item)
        self.sending_since = None

    async def wait(self, tasks: set[asyncio.Task]) -> set[asyncio.Task]:
        """Waits for some of `tasks` to finish, stopping the outbox if one send waits past the stall
        timeout meanwhile; returns the finished tasks (none once stopped)."""
        timeout = self.limits.send_stall_timeout
        loop = asyncio.get_running_loop()
        while self.stopped is None:
            done, _ = await asyncio.wait(
                tasks, timeout=stall_check_interval(timeout), return_when=asyncio.FIRST_COMPLETED
            )
            if done:
                return done
            since = self.sending_since
            if timeout > 0 and since is not None and loop.time() - since > timeout:
                self.stop(f"a {self.unit} waited {timeout:g} s to be sent")
        return set()

    def stop(self, why: str) -> None:
        """The client is not reading: drop its unsent output now; the owner aborts and ends the rest."""
        self.stopped = why
        self.items.clear()
        self.unsent = 0
        if self.sender is not None:
            self.sender.cancel()
