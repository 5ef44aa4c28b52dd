"""Slow and malformed HTTP clients: header and body deadlines, the connection cap, keep-alive, request
smuggling framing, and a client closing mid-body (issue 19, items 6-8).

Most tests run the app under uvicorn in this process (a thread with its own uvloop loop, no engine: /metrics
answers 200, a /v1 route reads its body and then answers 503) with the protocol and options `asyncengine
serve` uses, once per HTTP parser uvicorn may pick (h11; httptools when installed). The slow tests at the
end check the same through a real `asyncengine serve` and its stderr.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from reliability_helpers import ServerProcess, chat_model, start_server, stop
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from asyncengine.entrypoints import cli, launcher
from asyncengine.entrypoints.http_protocol import ConnectionLimits, uvicorn_options
from asyncengine.entrypoints.launcher import bind, run_loop
from asyncengine.entrypoints.server import build_app

pytestmark = pytest.mark.timeout(60)

SLACK_S = 1.5  # on top of a deadline, for a busy 2-core runner
PARSERS = [
    "h11",
    pytest.param(
        "httptools",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("httptools") is None, reason="httptools is not installed"
        ),
    ),
]


class AppServer:
    """build_app(None) under uvicorn in a thread, configured as the launcher configures it."""

    def __init__(self, limits: ConnectionLimits, http: str) -> None:
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        # log_config=None: uvicorn's loggers propagate to the root logger, where caplog sees them
        config = uvicorn.Config(
            build_app(None),
            lifespan="off",
            log_config=None,
            log_level="info",
            **uvicorn_options(limits, http),  # type: ignore[arg-type]
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=run_loop, args=(self.server.serve(sockets=[self.sock]),), name="uvicorn", daemon=True
        )

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(params=PARSERS)
def serve_app(request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> Iterator:
    """Starts AppServer(limits) for the test's parser; every one started is stopped after the test."""
    caplog.set_level(logging.INFO)  # the app's info lines too
    started: list[AppServer] = []

    def start(**limits: float) -> AppServer:
        srv = AppServer(ConnectionLimits(**limits), request.param)  # type: ignore[arg-type]
        srv.start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


# raw-socket helpers: every operation has a timeout


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def head(port: int, method: str = "GET", path: str = "/metrics", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}".encode()


def until_closed(
    socks: list[socket.socket], limit_s: float, trickle: bytes = b"", every_s: float = 0.2
) -> tuple[list[float | None], list[bytes]]:
    """Reads every socket (sending `trickle` on each every `every_s`) until the server closes them all or
    `limit_s` passes; returns when each closed (seconds from now, None if still open) and what it got."""
    start = time.monotonic()
    closed: dict[int, float] = {}
    got = [b""] * len(socks)
    next_trickle = start + every_s
    while len(closed) < len(socks) and (now := time.monotonic()) - start < limit_s:
        open_ = [i for i in range(len(socks)) if i not in closed]
        readable, _, _ = select.select([socks[i] for i in open_], [], [], 0.05)
        for i in open_:
            if socks[i] not in readable:
                continue
            try:
                data = socks[i].recv(65536)
            except OSError:  # reset: the server closed while we were writing
                data = b""
            got[i] += data
            if not data:
                closed[i] = time.monotonic() - start
        if trickle and now >= next_trickle:
            next_trickle += every_s
            for i in range(len(socks)):
                if i not in closed:
                    try:
                        socks[i].sendall(trickle)
                    except OSError:
                        closed[i] = time.monotonic() - start
    for s in socks:
        s.close()
    return [closed.get(i) for i in range(len(socks))], got


def request(port: int, raw: bytes, limit_s: float = 5.0) -> tuple[float | None, bytes]:
    """Sends a whole raw request on a new connection; returns (when the server closed it, all it got)."""
    s = connect(port)
    s.sendall(raw)
    closed, got = until_closed([s], limit_s)
    return closed[0], got[0]


def open_connections(srv: AppServer, count: int) -> list[socket.socket]:
    """`count` more idle connections, once the server has accepted them (uvicorn counts them from then on)."""
    total = len(srv.server.server_state.connections) + count
    socks = [connect(srv.port) for _ in range(count)]
    deadline = time.monotonic() + 5
    while len(srv.server.server_state.connections) < total:
        assert time.monotonic() < deadline, "the server did not accept the connections"
        time.sleep(0.01)
    return socks


def wait_connections(srv: AppServer, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(srv.server.server_state.connections) != count:
        assert time.monotonic() < deadline, srv.server.server_state.connections
        time.sleep(0.01)


# in-process: each parser


def test_slow_headers_are_cut_and_others_served(serve_app) -> None:
    srv = serve_app(header_timeout_s=1.0)
    slow = [connect(srv.port) for _ in range(20)]
    for s in slow:
        s.sendall(head(srv.port))  # the request line and Host, then one header line every 0.2 s, forever
    with httpx.Client(base_url=srv.base, timeout=5) as client:
        assert client.get("/metrics").status_code == 200  # served meanwhile
    closed, _ = until_closed(slow, 1.0 + 3 * SLACK_S, trickle=b"X-Slow: 1\r\n")
    assert all(t is not None for t in closed), f"still open: {closed}"
    assert max(closed) < 1.0 + SLACK_S, closed  # type: ignore[type-var]
    with httpx.Client(base_url=srv.base, timeout=5) as client:
        assert client.get("/metrics").status_code == 200


def test_header_timeout_answers_408_or_closes_a_silent_connection(serve_app) -> None:
    srv = serve_app(header_timeout_s=0.5)
    partial, silent = connect(srv.port), connect(srv.port)
    partial.sendall(head(srv.port))
    closed, got = until_closed([partial, silent], 0.5 + 2 * SLACK_S)
    assert got[0].startswith(b"HTTP/1.1 408 "), got[0]
    assert got[1] == b""  # nothing was asked: nothing to answer
    assert all(t is not None and t < 0.5 + SLACK_S for t in closed), closed


def test_slow_body_is_cut_with_408(serve_app, caplog: pytest.LogCaptureFixture) -> None:
    srv = serve_app(header_timeout_s=5.0, body_timeout_s=1.0)
    s = connect(srv.port)
    s.sendall(
        head(
            srv.port,
            "POST",
            "/v1/completions",
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{",
        )
    )
    closed, got = until_closed([s], 1.0 + 3 * SLACK_S, trickle=b" ")
    assert closed[0] is not None and closed[0] < 1.0 + SLACK_S, closed
    assert got[0].startswith(b"HTTP/1.1 408 "), got[0]
    assert_quiet_disconnect(caplog)


def test_body_in_time_and_pipelined_requests_are_served(serve_app) -> None:
    srv = serve_app(header_timeout_s=1.0, body_timeout_s=1.0)
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    s = connect(srv.port)
    s.sendall(
        head(
            srv.port,
            "POST",
            "/v1/completions",
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n",
        ).rstrip(b"\n")
    )
    time.sleep(0.3)  # the headers' last line and the body in parts, within both deadlines
    s.sendall(b"\n" + body[:5])
    time.sleep(0.3)
    # the body's rest, then two pipelined requests: neither timer may fire on them
    s.sendall(body[5:] + head(srv.port, extra="\r\n") + head(srv.port, extra="Connection: close\r\n\r\n"))
    _, got = until_closed([s], 5)
    # no engine: the completion is answered 503 once its body is read; then the two GETs
    assert got[0].count(b"HTTP/1.1 ") == 3 and b"HTTP/1.1 503 " in got[0] and b"408" not in got[0], got[0]


def test_idle_keep_alive_is_closed_after_its_own_timeout(serve_app) -> None:
    """A connection idle between requests is uvicorn's keep-alive's, even when longer than the header
    timeout."""
    srv = serve_app(header_timeout_s=0.5, keep_alive_s=2.0)
    s = connect(srv.port)
    s.sendall(head(srv.port, extra="\r\n"))
    time.sleep(1.2)  # idle past the header timeout: still open
    s.sendall(head(srv.port, extra="\r\n"))
    start = time.monotonic()
    closed, got = until_closed([s], 2.0 + 3 * SLACK_S)
    assert got[0].count(b"HTTP/1.1 200 ") == 2, got[0]
    assert closed[0] is not None and 2.0 - 0.3 < closed[0] < 2.0 + SLACK_S, (closed, time.monotonic() - start)


def test_websocket_idle_outlives_the_deadlines(serve_app) -> None:
    srv = serve_app(header_timeout_s=0.3, body_timeout_s=0.3, keep_alive_s=0.3)
    with ws_connect(f"ws://127.0.0.1:{srv.port}/v1/ws", open_timeout=5, close_timeout=2) as ws:
        time.sleep(1.5)  # idle for 5 x each deadline
        ws.send(json.dumps({"type": "generate", "request_id": "r1", "prompt": "hi", "params": {}}))
        frame = json.loads(ws.recv(timeout=5))
    assert frame["type"] == "error" and frame["code"] == 503, frame  # no engine: but still connected


def test_max_connections_answers_503_beyond(serve_app) -> None:
    srv = serve_app(max_connections=3)
    idle = open_connections(srv, 2)
    _, got = request(srv.port, head(srv.port, extra="Connection: close\r\n\r\n"))
    assert got.startswith(b"HTTP/1.1 200 "), got  # the third connection: served
    wait_connections(srv, 2)  # the served one closed
    idle += open_connections(srv, 1)
    _, got = request(srv.port, head(srv.port, extra="Connection: close\r\n\r\n"))
    assert got.startswith(b"HTTP/1.1 503 "), got  # the fourth
    with pytest.raises(InvalidStatus) as refused:  # a websocket is a connection too
        ws_connect(f"ws://127.0.0.1:{srv.port}/v1/ws", open_timeout=5)
    assert refused.value.response.status_code == 503
    for s in idle:
        s.close()
    wait_connections(srv, 0)
    with ws_connect(f"ws://127.0.0.1:{srv.port}/v1/ws", open_timeout=5, close_timeout=2):
        pass


VALID_BODY = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
VALID_CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(VALID_BODY), VALID_BODY)  # a valid request, chunked


def test_content_length_with_transfer_encoding_is_400(serve_app, caplog: pytest.LogCaptureFixture) -> None:
    srv = serve_app()
    closed, got = request(
        srv.port,
        head(
            srv.port,
            "POST",
            "/v1/completions",
            "Content-Type: application/json\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
        )
        + VALID_CHUNKED,
    )
    assert got.startswith(b"HTTP/1.1 400 "), got  # not the app's 503 (a valid request, but no engine)
    assert closed is not None  # and the connection closed: whatever follows is not a request
    assert not [
        r for r in caplog.records if r.name.startswith("asyncengine.entrypoints.server")
    ]  # app not reached


def test_client_closing_mid_body_logs_one_info_line(serve_app, caplog: pytest.LogCaptureFixture) -> None:
    srv = serve_app()
    s = connect(srv.port)
    s.sendall(
        head(
            srv.port,
            "POST",
            "/v1/completions",
            'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"prompt": ',
        )
    )
    time.sleep(0.2)
    s.close()
    assert_quiet_disconnect(caplog)


def disconnect_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "before the whole request body arrived" in r.getMessage()]


def assert_quiet_disconnect(caplog: pytest.LogCaptureFixture) -> None:
    """One info line for the request, no traceback, nothing at warning or above."""
    deadline = time.monotonic() + 5
    while not disconnect_records(caplog):  # the app logs it from the server's thread
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.02)
    time.sleep(0.2)  # and anything uvicorn would log after the app returned
    lines = disconnect_records(caplog)
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, lines
    loud = [
        (r.name, r.levelname, r.getMessage())
        for r in caplog.records
        if r.levelno >= logging.WARNING or r.exc_info
    ]
    assert not loud, loud


def test_serve_flags_and_env_reach_uvicorn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[launcher.ServeOptions] = []
    monkeypatch.setattr(launcher, "run", lambda config, opts: seen.append(opts) or 0)
    monkeypatch.setenv("ASYNCENGINE_TIMEOUT_BODY", "7.5")
    (tmp_path / "config.json").write_text("{}")  # the CLI checks for a model directory before serving
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--model",
            str(tmp_path),
            "--timeout-header",
            "2",
            "--max-connections",
            "9",
            "--timeout-keep-alive",
            "3",
        ]
    )
    assert cli.cmd_serve(args) == 0
    assert seen[0].connections == ConnectionLimits(
        header_timeout_s=2.0, body_timeout_s=7.5, keep_alive_s=3.0, max_connections=9
    )
    options = uvicorn_options(seen[0].connections)
    assert options["limit_concurrency"] == 10 and options["timeout_keep_alive"] == 3.0
    defaults = cli.build_parser().parse_args(["serve", "--model", "m"])
    assert (defaults.timeout_header, defaults.timeout_keep_alive, defaults.max_connections) == (
        10.0,
        5.0,
        1024,
    )
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--model", "m", "--max-connections", "0"])


# a real `asyncengine serve`: the probe's view, and the log it writes

HEADER_S, BODY_S, KEEP_ALIVE_S, MAX_CONNECTIONS = 1.0, 1.0, 2.0, 24


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = chat_model(tmp_path_factory)
    srv = start_server(
        model,
        tmp_path_factory.mktemp("slow-clients"),
        "--num-threads",
        "1",
        "--timeout-header",
        str(HEADER_S),
        "--timeout-body",
        str(BODY_S),
        "--timeout-keep-alive",
        str(KEEP_ALIVE_S),
        "--max-connections",
        str(MAX_CONNECTIONS),
    )
    yield srv
    stop(srv)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_served_slowloris_is_cut_while_completions_work(served: ServerProcess) -> None:
    slow = [connect(served.port) for _ in range(20)]
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    with httpx.Client(base_url=served.base, timeout=60) as client:
        reply = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200, reply.text
    closed, _ = until_closed(slow, HEADER_S + 3 * SLACK_S, trickle=b"X-Slow: 1\r\n")
    assert all(t is not None and t < HEADER_S + SLACK_S for t in closed), closed
    # a body trickle: cut with 408
    s = connect(served.port)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    closed, got = until_closed([s], BODY_S + 3 * SLACK_S, trickle=b" ")
    assert closed[0] is not None and closed[0] < BODY_S + SLACK_S and got[0].startswith(b"HTTP/1.1 408 "), got


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_served_limits_framing_and_keep_alive(served: ServerProcess) -> None:
    idle = [connect(served.port) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.2)  # accepted (well within the header timeout, which would close them)
    _, got = request(served.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 503 ") and b"Service Unavailable" in got, got
    for s in idle:
        s.close()
    time.sleep(0.2)
    closed, got = request(
        served.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + VALID_CHUNKED,
    )
    assert got.startswith(b"HTTP/1.1 400 ") and closed is not None, got  # not a 200 completion
    s = connect(served.port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    closed, got = until_closed([s], KEEP_ALIVE_S + 3 * SLACK_S)
    assert got[0].startswith(b"HTTP/1.1 200 ") and closed[0] is not None, (closed, got)
    assert KEEP_ALIVE_S - 0.3 < closed[0] < KEEP_ALIVE_S + SLACK_S, closed


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_served_mid_body_close_logs_no_traceback(served: ServerProcess) -> None:
    log: Path = served.log
    line = "POST /v1/chat/completions: connection closed before the whole request body arrived"
    s = connect(served.port)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"messages"'
    )
    time.sleep(0.2)
    s.close()
    deadline = time.monotonic() + 10
    while line not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    time.sleep(0.3)
    text = log.read_text()  # the server's whole stderr, the other tests' requests included
    assert "Traceback" not in text and " ERROR " not in text and "ERROR:" not in text, text[-3000:]
    found = [x for x in text.splitlines() if line in x]
    assert len(found) == 1 and " INFO " in found[0], found
