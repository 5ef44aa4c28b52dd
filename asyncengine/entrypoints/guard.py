"""GuardMiddleware: what every request passes before a route: the Host and Origin checks (OriginPolicy),
the API key on /v1, JSON bodies for POST, and the body-size bound.

The API key comes as `Authorization: Bearer KEY`; a websocket handshake may carry it instead as the
subprotocol `asyncengine.bearer.KEY` beside a plain `asyncengine` one (a browser cannot set headers on a
WebSocket; Kubernetes does the same), and the server answers with `asyncengine`. Never in a query string,
which ends up in logs and history."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asyncengine.entrypoints.api_errors import PayloadTooLargeError, error_body
from asyncengine.entrypoints.server_state import ServerState


def api_key_ok(headers: list[tuple[bytes, bytes]], api_key: str) -> bool:
    value = next((v for k, v in headers if k == b"authorization"), b"")
    scheme, _, token = value.partition(b" ")
    # constant-time, so a wrong key leaks nothing about the right one through timing
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode())


WS_PROTOCOL = "asyncengine"  # what the server answers a handshake that offers it
BEARER_PROTOCOL = b"asyncengine.bearer."  # + the key: a subprotocol, since browsers cannot set headers


def subprotocol_key_ok(headers: list[tuple[bytes, bytes]], api_key: str) -> bool:
    """Whether a websocket handshake offers the subprotocol `asyncengine.bearer.<api_key>`."""
    offered = [p.strip() for k, v in headers if k == b"sec-websocket-protocol" for p in v.split(b",")]
    key = api_key.encode()
    # constant-time per candidate, as api_key_ok; every candidate is compared (no early exit)
    matches = [
        hmac.compare_digest(p[len(BEARER_PROTOCOL) :], key) for p in offered if p.startswith(BEARER_PROTOCOL)
    ]
    return any(matches)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class OriginPolicy:
    """Which Host headers and browser Origins the server answers (against DNS rebinding and pages that
    drive a local server from the user's browser).

    `allowed_hosts`: hostnames (no port) a request's Host header may name; None allows any. `allowed_origins`:
    origins (scheme://host[:port]) whose browser requests are served, besides the server's own
    (an Origin whose host:port is the request's Host); "*" allows any. Requests without an Origin header
    (curl, SDKs, non-browser websocket clients) are not browser requests and pass.
    """

    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()

    @classmethod
    def for_bind(
        cls, host: str, allowed_hosts: list[str] | None = None, allowed_origins: list[str] | None = None
    ) -> OriginPolicy:
        """The default for a server bound to `host`: a loopback server answers only loopback names (what
        a DNS-rebinding page cannot send); a wildcard bind any name; another address that address and the
        loopback names. `allowed_hosts` ("*" for any) replaces the default."""
        if allowed_hosts:
            hosts = None if "*" in allowed_hosts else tuple(h.strip("[]").lower() for h in allowed_hosts)
        elif host in ("", "0.0.0.0", "::"):
            hosts = None
        else:
            hosts = tuple(dict.fromkeys((host.strip("[]").lower(), *LOOPBACK_HOSTS)))
        return cls(hosts, tuple(o.rstrip("/").lower() for o in allowed_origins or ()))

    def host_ok(self, host: bytes | None) -> bool:
        if self.allowed_hosts is None:
            return True
        if not host:
            return False
        name = host.decode("latin-1").lower()
        name = name[1 : name.find("]")] if name.startswith("[") else name.rsplit(":", 1)[0]
        return name in self.allowed_hosts

    def origin_ok(self, origin: bytes | None, host: bytes | None) -> bool:
        if origin is None:
            return True
        value = origin.decode("latin-1").rstrip("/").lower()
        if "*" in self.allowed_origins or value in self.allowed_origins:
            return True
        # same origin: the page was served by this server under the name the request was sent to
        return host is not None and value.partition("://")[2] == host.decode("latin-1").lower()


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


def _is_json(content_type: bytes | None) -> bool:
    return content_type is not None and content_type.split(b";")[0].strip().lower() == b"application/json"


class GuardMiddleware:
    """Pure ASGI: checks Host and Origin, the API key on /v1 (HTTP and websocket), that POST bodies are
    JSON, and bounds HTTP body size."""

    def __init__(self, app: ASGIApp, state: ServerState, policy: OriginPolicy | None = None) -> None:
        self.app = app
        self.state = state
        self.policy = policy or OriginPolicy()

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, message: str, status: int) -> None:
        if scope["type"] == "websocket":
            await self._reject_websocket(scope, receive, send, message, status)
        else:
            await JSONResponse(error_body(message, status), status)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = _header(scope, b"host")
        if not self.policy.host_ok(host):
            await self._refuse(scope, receive, send, "this server does not answer to that Host header", 421)
            return
        if not self.policy.origin_ok(_header(scope, b"origin"), host):
            await self._refuse(
                scope, receive, send, "cross-origin requests are not allowed (see --allowed-origins)", 403
            )
            return
        # a CORS preflight carries no credentials; CORSMiddleware answers it (405 without allowed origins)
        protected = scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS"
        if protected and self.state.api_key and not self._key_ok(scope, self.state.api_key):
            await self._refuse(scope, receive, send, "invalid or missing API key", 401)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.state.limits.max_body_bytes
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        if length.isdigit() and int(length) > limit:
            body = error_body(f"request body over {limit} bytes", 413)
            await JSONResponse(body, 413)(scope, receive, send)
            return
        has_body = length not in (b"", b"0") or _header(scope, b"transfer-encoding") is not None
        if scope["method"] == "POST" and has_body and not _is_json(_header(scope, b"content-type")):
            # NOTE: also what keeps a page's text/plain "simple request" (no CORS preflight) out
            await self._refuse(
                scope, receive, send, "send the body as JSON (Content-Type: application/json)", 415
            )
            return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # chunked bodies carry no content-length
                raise PayloadTooLargeError(f"request body over {limit} bytes")
            return message

        await self.app(scope, bounded_receive, send)

    @staticmethod
    def _key_ok(scope: Scope, api_key: str) -> bool:
        if api_key_ok(scope["headers"], api_key):
            return True
        return scope["type"] == "websocket" and subprotocol_key_ok(scope["headers"], api_key)

    @staticmethod
    async def _reject_websocket(
        scope: Scope, receive: Receive, send: Send, message: str, status: int
    ) -> None:
        await receive()  # websocket.connect
        if "websocket.http.response" in scope.get("extensions", {}):
            await JSONResponse(error_body(message, status), status)(scope, receive, send)
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": message})
