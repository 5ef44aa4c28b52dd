"""uvicorn's HTTP/1.1 protocol with the connection limits it lacks (slowloris, request smuggling).

uvicorn closes a keep-alive connection that stays idle between requests (`timeout_keep_alive`) and answers
503 to requests beyond `limit_concurrency`, but it waits forever for a request's headers or body: a client
sending them a byte at a time holds its socket, and its slot under the limit, for as long as it likes.
The protocols here add two timers, armed and cancelled like uvicorn's keep-alive timer:

- headers: a request's line and headers must arrive within `header_timeout_s` of the connection opening or
  of the request's first byte (a keep-alive connection waiting for its next request is uvicorn's: it
  closes it after `timeout_keep_alive`). Then 408 (silent close if nothing came) and the connection closes.
- body: the whole request body must arrive within `body_timeout_s` of the end of its headers, while the
  server is reading it. Then 408 if no response has started, the app's receive() sees a disconnect
  (Starlette's ClientDisconnect) and the connection closes.

A websocket is untouched once upgraded (it may idle for minutes; uvicorn's pings find dead peers), but its
upgrade counts against the connection cap, which uvicorn checks for plain HTTP requests only.

With h11 the protocol also rejects a request framed by both Content-Length and Transfer-Encoding with 400
and closes the connection (RFC 9112 section 6.1: a request smuggling risk); h11 would use the chunked
framing and ignore Content-Length. httptools (llhttp) rejects such a request on its own.

Which parser: httptools when installed, else h11, as uvicorn's http="auto" picks.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Literal

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0  # request line + headers (0: no limit)
    body_timeout_s: float = 30.0  # the whole request body (0: no limit)
    keep_alive_s: float = 5.0  # an idle connection between requests (uvicorn's timeout_keep_alive)
    max_connections: int = 1024  # open connections, websockets included; requests beyond get 503


def uvicorn_options(
    limits: ConnectionLimits, http: Literal["auto", "h11", "httptools"] = "auto"
) -> dict[str, Any]:
    """The uvicorn.Config keyword arguments that enforce `limits`."""
    return {
        "http": protocol_class(limits, http),
        # NOTE: uvicorn answers 503 once `limit_concurrency` connections are open counting the one asking,
        # so max_connections + 1 serves exactly max_connections
        "limit_concurrency": limits.max_connections + 1,
        "timeout_keep_alive": limits.keep_alive_s,
    }


def protocol_class(
    limits: ConnectionLimits, http: Literal["auto", "h11", "httptools"] = "auto"
) -> type[asyncio.Protocol]:
    """A protocol class for uvicorn.Config(http=...) that enforces `limits`' timeouts."""
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    base = _httptools_protocol() if http == "httptools" else H11DeadlineProtocol
    return type(base.__name__, (base,), {"limits": limits})


def _reply_and_close(transport: asyncio.Transport, status: int, reason: str) -> None:
    """Writes a minimal response past the parser's state machine (the connection ends here) and closes."""
    body = reason.encode()
    transport.write(
        b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, body, len(body), body)
    )
    transport.close()


class _Deadlines:
    """The header and body timers, mixed in before one of uvicorn's HTTP protocol classes."""

    limits: ConnectionLimits = ConnectionLimits()  # protocol_class() sets the configured ones
    # uvicorn's protocol state used here (both uvicorn protocols have it)
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any  # the current request's RequestResponseCycle, None before the first request
    flow: Any  # FlowControl: read_paused
    timeout_keep_alive_task: asyncio.TimerHandle | None
    limit_concurrency: int | None
    connections: set[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = True  # no request is being read or served
        self._request_bytes = False  # part of the awaited request arrived: a header timeout answers 408

    # Protocol interface (and uvicorn's hooks), each calling uvicorn's own
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._start_header_timer()  # even before a first byte: uvicorn has no timer for a silent client

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers:
            self._request_bytes = True
            if self._header_timer is None:  # the first byte after a response: uvicorn's keep-alive ends here
                self._start_header_timer()
        super().data_received(data)  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self.timeout_keep_alive_task is not None:  # uvicorn waits for the next request (none pipelined)
            self._awaiting_headers, self._request_bytes = True, False

    def handle_websocket_upgrade(self, *args: Any) -> None:
        self._cancel_timers()  # the websocket protocol owns the connection from here
        self._awaiting_headers = False
        # NOTE: uvicorn checks limit_concurrency for HTTP requests only, and a websocket holds a connection
        # longest; `connections` holds this one too, as when uvicorn checks
        if self.limit_concurrency is not None and len(self.connections) >= self.limit_concurrency:
            logger.warning("websocket refused: %d connections open", len(self.connections))
            _reply_and_close(self.transport, 503, "Service Unavailable")
            return
        super().handle_websocket_upgrade(*args)  # type: ignore[misc]

    # Called by the parser-specific subclasses
    def _headers_complete(self) -> None:
        self._awaiting_headers = False
        self._cancel_timers()
        if self.limits.body_timeout_s > 0:
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _body_complete(self) -> None:
        self._cancel(self._body_timer)
        self._body_timer = None

    # Timers
    def _start_header_timer(self) -> None:
        self._cancel(self._header_timer)
        self._header_timer = None
        if self.limits.header_timeout_s > 0:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        logger.debug("closing a connection: no request headers within %ss", self.limits.header_timeout_s)
        if self._request_bytes:
            _reply_and_close(self.transport, 408, "Request Timeout")
        else:  # a silent connection (a browser's preconnect, or a slowloris): nothing to answer
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server stopped reading (the app is behind, a pipelined request waits)
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
            return
        logger.debug("closing a connection: request body not received within %ss", self.limits.body_timeout_s)
        cycle = self.cycle
        if cycle is not None:
            # NOTE: as connection_lost would, but now: no response of the app's may follow the 408 below
            cycle.disconnected = True
            cycle.message_event.set()  # the app's receive() returns http.disconnect
        if cycle is not None and not cycle.response_started:
            _reply_and_close(self.transport, 408, "Request Timeout")
        else:
            self.transport.close()

    def _cancel_timers(self) -> None:
        self._cancel(self._header_timer)
        self._cancel(self._body_timer)
        self._header_timer = self._body_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


class _StrictH11Connection(h11.Connection):
    """h11, less its one leniency that enables request smuggling: Content-Length with Transfer-Encoding."""

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                # uvicorn answers a RemoteProtocolError with 400 and closes the connection
                raise h11.RemoteProtocolError(
                    "both Content-Length and Transfer-Encoding", error_status_hint=400
                )
        return event


class H11DeadlineProtocol(_Deadlines, H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        size = self.config.h11_max_incomplete_event_size
        self.conn = _StrictH11Connection(
            h11.SERVER, DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if size is None else size
        )

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        # uvicorn makes a new cycle the moment h11 has parsed a request's headers (not for a websocket)
        if self.cycle is not cycle:
            self._headers_complete()
        if self._body_timer is not None and self.conn.their_state is not h11.SEND_BODY:
            self._body_complete()  # the whole request arrived (or the request failed)


@functools.cache
def _httptools_protocol() -> type[_Deadlines]:
    # httptools is optional (uvicorn[standard]); this import needs it
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsDeadlineProtocol(_Deadlines, HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._body_complete()

    return HttpToolsDeadlineProtocol
