"""AsyncClient: many concurrent generations over one websocket to `asyncengine serve` (/v1/ws).

    async with AsyncClient("ws://127.0.0.1:8000/v1/ws", api_key=None) as client:
        async for delta in client.generate("Hello", max_tokens=32, temperature=0.0):
            print(delta.text, end="")

One reader task dispatches the server's frames to per-request queues by request id. Leaving the
`async for` early cancels the request on the server (wrap it in contextlib.aclosing to cancel at once
rather than when the generator is collected). A dropped connection fails the requests in flight with
ConnectionLost; the next generate reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

logger = logging.getLogger(__name__)


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Delta:
    """New text and tokens of one request; the last one carries finish_reason and usage (and no text)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[list[dict[str, Any]]] | None = None  # per token: candidates, the sampled one first
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    usage: Usage | None = None


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage


class ClientError(Exception):
    """Base class of the client's errors."""


class ClientConnectionError(ClientError, ConnectionError):
    """The server cannot be reached."""


class ConnectionLost(ClientConnectionError):
    """The connection dropped while the request was in flight; the next request reconnects."""


class ServerError(ClientError):
    """The server answered with an `error` frame (or refused the connection with an HTTP status)."""

    def __init__(self, code: int, message: str, request_id: str | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class BadRequestError(ServerError):
    """400: bad params, prompt too long, malformed frame."""


class AuthenticationError(ServerError):
    """401: a missing or wrong API key."""


class PayloadTooLargeError(ServerError):
    """413: the frame is too large."""


class RateLimitError(ServerError):
    """429: too many live requests on the connection or the server."""


class InternalServerError(ServerError):
    """500: a bug on the server."""


class ServiceUnavailableError(ServerError):
    """503: the model is loading, the server is shutting down, or the engine died."""


ERRORS: dict[int, type[ServerError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    413: PayloadTooLargeError,
    429: RateLimitError,
    500: InternalServerError,
    503: ServiceUnavailableError,
}


def server_error(code: int, message: str, request_id: str | None = None) -> ServerError:
    return ERRORS.get(code, ServerError)(code, message, request_id)


@dataclass
class _Connection:
    ws: ClientConnection
    queues: dict[str, asyncio.Queue] = field(default_factory=dict)
    reader: asyncio.Task | None = None
    lost: bool = False


class AsyncClient:
    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        open_timeout: float = 10.0,
        max_frame_bytes: int = 16 * 2**20,
    ) -> None:
        self.url = url
        self.api_key = api_key
        self.open_timeout = open_timeout
        self.max_frame_bytes = max_frame_bytes
        self._conn: _Connection | None = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connection -------------------------------------------------------------------------------
    async def connect(self) -> None:
        """Opens the connection now (generate also opens it on demand)."""
        await self._connection()

    async def _connection(self) -> _Connection:
        async with self._lock:
            if self._conn is not None and not self._conn.lost:
                return self._conn
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            try:
                ws = await connect(
                    self.url,
                    additional_headers=headers,
                    open_timeout=self.open_timeout,
                    max_size=self.max_frame_bytes,
                )
            except InvalidStatus as e:
                status = e.response.status_code
                raise server_error(status, f"server refused the websocket: HTTP {status}") from None
            except (OSError, TimeoutError, WebSocketException) as e:
                raise ClientConnectionError(f"cannot connect to {self.url}: {e}") from e
            conn = _Connection(ws)
            conn.reader = asyncio.create_task(self._read(conn), name="asyncengine-client-reader")
            self._conn = conn
            return conn

    async def _read(self, conn: _Connection) -> None:
        reason = "the connection closed"
        try:
            async for raw in conn.ws:
                try:
                    frame = json.loads(raw)
                    queue = conn.queues.get(frame.get("request_id"))
                except (ValueError, AttributeError, TypeError):
                    logger.warning("dropped a malformed frame from the server")
                    continue
                if queue is not None:
                    queue.put_nowait(frame)
                elif frame.get("type") == "error":
                    logger.warning("server error: %s", frame.get("message"))
        except ConnectionClosed as e:
            reason = f"the connection closed ({e})"
        finally:
            conn.lost = True
            for queue in conn.queues.values():
                queue.put_nowait(ConnectionLost(reason))

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.ws.close()
            if conn.reader is not None:
                await asyncio.gather(conn.reader, return_exceptions=True)

    # -- requests ---------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int | None = 16,
        temperature: float = 1.0,
        request_id: str | None = None,
        **params: Any,
    ) -> AsyncIterator[Delta]:
        """Streams the deltas of one request; `params` are SamplingParams fields (top_p, seed, stop, ...)."""
        conn = await self._connection()
        request_id = request_id or uuid.uuid4().hex
        if request_id in conn.queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        frame: dict[str, Any] = {
            "type": "generate",
            "request_id": request_id,
            "params": {"max_tokens": max_tokens, "temperature": temperature, **params},
        }
        frame["prompt" if isinstance(prompt, str) else "prompt_token_ids"] = prompt
        queue: asyncio.Queue = asyncio.Queue()
        conn.queues[request_id] = queue
        over = False
        try:
            await self._send(conn, frame)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    over = True
                    raise item
                kind = item.get("type")
                if kind == "delta":
                    yield Delta(
                        request_id, item.get("text", ""), item.get("token_ids", []), item.get("logprobs")
                    )
                elif kind == "done":
                    over = True
                    u = item.get("usage") or {}
                    yield Delta(
                        request_id,
                        "",
                        [],
                        None,
                        item.get("finish_reason"),
                        Usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0)),
                    )
                    return
                elif kind == "error":
                    over = True
                    raise server_error(int(item.get("code", 500)), str(item.get("message")), request_id)
        finally:
            conn.queues.pop(request_id, None)
            if not over and not conn.lost:  # left early: free the server's resources
                with contextlib.suppress(ClientError):
                    await self._send(conn, {"type": "cancel", "request_id": request_id})

    async def complete(self, prompt: str | list[int], **kwargs: Any) -> Completion:
        """The whole completion of one request."""
        text, ids = [], []
        last = None
        async for delta in self.generate(prompt, **kwargs):
            text.append(delta.text)
            ids.extend(delta.token_ids)
            last = delta
        assert last is not None and last.usage is not None and last.finish_reason is not None
        return Completion("".join(text), ids, last.finish_reason, last.usage)

    async def _send(self, conn: _Connection, frame: dict[str, Any]) -> None:
        try:
            await conn.ws.send(json.dumps(frame, separators=(",", ":")))
        except ConnectionClosed as e:
            conn.lost = True
            raise ConnectionLost(f"the connection closed ({e})") from None
