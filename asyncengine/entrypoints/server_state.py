"""What the server's routes share: the limits, and ServerState (the engine once loaded, the API key,
the live-request count, draining). Its own module, so the routes and the app import it one way."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from asyncengine.engine import AsyncEngine
from asyncengine.entrypoints.api_errors import NotReadyError, TooManyRequestsError
from asyncengine.errors import EngineDeadError, EngineShutdownError


@dataclass(frozen=True)
class ServerLimits:
    max_live_requests: int = 4096  # generating requests, HTTP and websocket together
    max_live_per_connection: int = 1024  # generating requests on one websocket
    max_body_bytes: int = 10 * 2**20  # HTTP request body
    max_frame_bytes: int = 2**20  # websocket text frame
    # output a client has not taken yet (one websocket connection, one SSE response): past it, or when one
    # send waits send_stall_timeout seconds (0: no limit), its requests are aborted and it is closed
    max_unsent_bytes: int = 8 * 2**20
    send_stall_timeout: float = 15.0  # under uvicorn's 20 s ping, so our close reason comes first


class ServerState:
    """What the routes share: the engine (None while loading), limits, the API key, live-request count."""

    def __init__(
        self,
        engine: AsyncEngine | None,
        api_key: str | None,
        limits: ServerLimits,
        model_name: str | None,
        tool_call_parser: str | None = None,
    ) -> None:
        self.engine: AsyncEngine | None = None
        self.api_key = api_key
        self.limits = limits
        self.model_name = model_name or ""
        # --tool-call-parser: how tool_choice "auto" reads calls (None or "auto": by the chat template)
        self.tool_call_parser = tool_call_parser
        self.live = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: AsyncEngine) -> None:
        """Starts serving `engine`; /health turns 200."""
        self.engine = engine
        if not self.model_name:
            self.model_name = Path(engine.config.model).name

    def require_engine(self) -> AsyncEngine:
        """The engine, or a 503 error while loading, draining, shutting down or dead."""
        if self.draining:
            raise NotReadyError("the server is shutting down")
        engine = self.engine
        if engine is None:
            raise NotReadyError("the model is still loading")
        if engine.dead is not None:
            raise EngineDeadError(f"the engine is dead: {engine.dead}")
        if engine.closing:
            raise EngineShutdownError("the engine is shutting down")
        return engine

    def health(self) -> str:
        if self.engine is None:
            return "loading"
        if self.engine.dead is not None:
            return "dead"
        if self.draining or not self.engine.is_running:
            return "shutting_down"
        if getattr(self.engine, "degraded", None):  # data parallel: some replicas dead, others serving
            return "degraded"
        return "ok"

    def acquire(self, count: int = 1) -> int:
        """Takes `count` slots of the global live-request limit (429 when they are not free)."""
        if self.live + count > self.limits.max_live_requests:
            raise TooManyRequestsError(
                f"the server has {self.live} live requests "
                f"(limit {self.limits.max_live_requests}); retry later"
            )
        self.live += count
        self._idle.clear()
        return count

    def release(self, count: int = 1) -> None:
        self.live -= count
        if self.live <= 0:
            self.live = 0
            self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Refuses new requests and waits up to timeout_s for live ones; True if all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
