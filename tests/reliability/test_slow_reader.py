"""A client that does not read its output is dropped, not buffered for (issue 19, item 3).

Before, a websocket client that sent hundreds of long requests and never read grew the server without bound
(its request tasks waited on a full outbox, so the engine's per-request queues grew) and kept every request
in the batch. Now a connection (or SSE response) whose unsent output passes ServerLimits.max_unsent_bytes,
or whose send waits send_stall_timeout seconds, has its requests aborted and is closed (websocket: code 1008
"client is not reading its output"; SSE: an in-band error), while a client that reads, even a burst of
200 requests, never comes near the bound.

The first tests drive the websocket Connection and SSEResponse over fakes (fast); the slow ones run
`asyncengine serve` and raw sockets with a tiny receive buffer that stop reading after the handshake.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_helpers import FakeEngine, ServerProcess, chat_model, server_process, start_server, stop
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.protocol import State
from websockets.uri import parse_uri

from asyncengine.entrypoints import streams, websocket
from asyncengine.entrypoints.server_state import ServerLimits, ServerState
from asyncengine.entrypoints.streams import NOT_READING, SSEResponse
from asyncengine.entrypoints.websocket import Connection
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)
metric, ABORTS = server_process.metric, server_process.ABORTS


# -- fakes --------------------------------------------------------------------------------------------
class EndlessEngine(FakeEngine):
    """Streams a 40-character delta every `delay` seconds until max_tokens (None: until aborted)."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(delay=delay)

    def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        self.live.add(request_id)
        return self._stream(params.max_tokens if params.ignore_eos else None, request_id)

    async def _stream(self, max_tokens: int | None, request_id: str) -> AsyncIterator[RequestOutput]:
        i = 0
        try:
            while request_id not in self.aborted:
                await asyncio.sleep(self.delay)
                i += 1
                reason = "length" if i == max_tokens else None
                yield RequestOutput(
                    request_id,
                    None,
                    [1, 2],
                    [CompletionOutput(0, "x" * 40, [i], None, None, reason)],
                    reason is not None,
                )
                if reason is not None:
                    return
        finally:
            if request_id in self.live and i != max_tokens:
                self.aborted.add(request_id)  # left early: what the real engine's stream aborts
            self.live.discard(request_id)


class FakeWebSocket:
    """Delivers `frames`, then stays connected and silent; takes `reads` frames (None: all), then no more:
    send_text then waits, as uvicorn's does while the socket's buffers are full."""

    def __init__(self, frames: list[dict], reads: int | None = None, take_close: bool = True) -> None:
        self.incoming = [{"type": "websocket.receive", "text": json.dumps(f)} for f in frames]
        self.reads = reads
        self.take_close = take_close
        self.sent: list[dict] = []
        self.closed: tuple[int, str] | None = None
        self.conn: Connection | None = None
        self.peak_unsent = 0
        self.forever = asyncio.Event()

    async def receive(self) -> dict:
        if self.incoming:
            return self.incoming.pop(0)
        await self.forever.wait()
        raise AssertionError("unreachable")

    async def send_text(self, text: str) -> None:
        if self.reads is not None and len(self.sent) >= self.reads:
            await self.forever.wait()
        assert self.conn is not None
        self.peak_unsent = max(self.peak_unsent, self.conn.unsent)
        self.sent.append(json.loads(text))

    async def close(self, code: int, reason: str) -> None:
        if not self.take_close:
            await self.forever.wait()
        self.closed = (code, reason)


def generate_frames(n: int, **params: Any) -> list[dict]:
    return [{"type": "generate", "request_id": f"r{i}", "prompt": "hi", "params": params} for i in range(n)]


async def run_connection(
    ws: FakeWebSocket, engine: EndlessEngine, limits: ServerLimits, timeout_s: float
) -> tuple[ServerState, float]:
    state = ServerState(engine, None, limits, "fake")  # type: ignore[arg-type]
    conn = Connection(ws, state)  # type: ignore[arg-type]
    ws.conn = conn
    t0 = time.monotonic()
    await asyncio.wait_for(conn.run(), timeout_s)
    return state, time.monotonic() - t0


def not_reading_logs(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if NOT_READING in r.getMessage()]


# -- websocket Connection over fakes ------------------------------------------------------------------
async def test_websocket_over_unsent_bytes_aborts_and_closes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    engine = EndlessEngine()
    ws = FakeWebSocket(generate_frames(50), reads=10)
    state, took = await run_connection(
        ws, engine, ServerLimits(max_unsent_bytes=100_000, send_stall_timeout=60), timeout_s=10
    )
    assert ws.closed == (1008, NOT_READING)
    assert len(engine.aborted) == 50 and not engine.live and state.live == 0
    [record] = not_reading_logs(caplog)
    assert record.levelno == logging.INFO and "byte limit" in record.getMessage(), record.getMessage()
    print(f"websocket over 100000 unsent bytes: closed in {took:.2f}s")


async def test_websocket_send_stall_aborts_and_closes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    engine = EndlessEngine(delay=0.01)  # output too slow to reach the byte limit: the stall timer ends it
    ws = FakeWebSocket(generate_frames(5), reads=1)
    state, took = await run_connection(ws, engine, ServerLimits(send_stall_timeout=0.3), timeout_s=10)
    assert ws.closed == (1008, NOT_READING)
    assert len(engine.aborted) == 5 and not engine.live and state.live == 0
    [record] = not_reading_logs(caplog)
    assert "waited 0.3 s" in record.getMessage(), record.getMessage()
    assert 0.3 <= took < 2.0


async def test_websocket_close_gives_up_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(websocket, "CLOSE_GRACE_S", 0.2)
    engine = EndlessEngine()
    ws = FakeWebSocket(generate_frames(3), reads=0, take_close=False)  # not even the close frame goes out
    state, took = await run_connection(ws, engine, ServerLimits(max_unsent_bytes=10_000), timeout_s=10)
    assert ws.closed is None and not engine.live and state.live == 0
    assert took < 3.0


async def test_websocket_fast_reader_burst_stays_far_under_the_bound() -> None:
    engine = EndlessEngine()
    ws = FakeWebSocket(generate_frames(200, max_tokens=50, ignore_eos=True))
    # the client stays connected after its requests end: run() returns only through the limits, so stop it
    state = ServerState(engine, None, ServerLimits(), "fake")  # type: ignore[arg-type]
    conn = Connection(ws, state)  # type: ignore[arg-type]
    ws.conn = conn
    task = asyncio.create_task(conn.run())
    deadline = time.monotonic() + 20
    while sum(f["type"] == "done" for f in ws.sent) < 200 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    done = [f for f in ws.sent if f["type"] == "done"]
    assert len(done) == 200 and {f["finish_reason"] for f in done} == {"length"}
    assert conn.stopped is None and ws.closed is None
    print(
        f"fast reader, 200 requests: peak unsent {ws.peak_unsent} bytes "
        f"(limit {ServerLimits().max_unsent_bytes})"
    )
    assert ws.peak_unsent < ServerLimits().max_unsent_bytes // 32


# -- SSEResponse over fakes ---------------------------------------------------------------------------
class FakeSend:
    """An ASGI send that takes `reads` body chunks, then waits until `resume` is set."""

    def __init__(self, reads: int) -> None:
        self.reads = reads
        self.messages: list[dict] = []
        self.resume = asyncio.Event()

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.body" and len(self.messages) > self.reads:
            await self.resume.wait()
        self.messages.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages)


async def endless_events(closed: list[bool], delay: float = 0.0) -> AsyncIterator[str]:
    try:
        while True:
            await asyncio.sleep(delay)
            yield "data: " + "x" * 100 + "\n\n"
    finally:
        closed.append(True)  # _events' cleanup here aborts its requests and releases its slots


@pytest.mark.parametrize(
    "limits, why",
    [
        (ServerLimits(max_unsent_bytes=50_000, send_stall_timeout=60), "byte limit"),
        (ServerLimits(send_stall_timeout=0.3), "waited 0.3 s"),
    ],
)
async def test_sse_client_not_reading_is_aborted_and_ended(
    limits: ServerLimits, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    closed: list[bool] = []
    response = SSEResponse(
        endless_events(closed, delay=0.0 if limits.send_stall_timeout > 1 else 0.01), limits, "cmpl-1"
    )
    send = FakeSend(reads=5)
    task = asyncio.create_task(response.stream_response(send))
    t0 = time.monotonic()
    while response.stopped is None and time.monotonic() - t0 < 5:
        await asyncio.sleep(0.01)
    took = time.monotonic() - t0
    assert response.stopped is not None and why in response.stopped, response.stopped
    send.resume.set()  # the client reads again: it gets the error and a proper end
    await asyncio.wait_for(task, 5)
    assert closed == [True]
    assert NOT_READING.encode() in send.body and send.body.endswith(b"data: [DONE]\n\n")
    assert send.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    [record] = not_reading_logs(caplog)
    assert record.levelno == logging.INFO and "cmpl-1" in record.getMessage()
    print(f"SSE ({why}): stopped after {took:.2f}s")


async def test_sse_end_gives_up_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "CLOSE_GRACE_S", 0.2)
    closed: list[bool] = []
    response = SSEResponse(endless_events(closed), ServerLimits(max_unsent_bytes=20_000), "cmpl-2")
    send = FakeSend(reads=0)
    await asyncio.wait_for(response.stream_response(send), 5)
    assert closed == [True] and response.stopped is not None
    assert not any(m.get("more_body") is False for m in send.messages)


async def test_sse_reader_gets_everything() -> None:
    async def events() -> AsyncIterator[str]:
        for i in range(2000):
            if i % 100 == 0:
                await asyncio.sleep(0)
            yield f"data: {i}\n\n"

    send = FakeSend(reads=10**9)
    await asyncio.wait_for(
        SSEResponse(events(), ServerLimits(max_unsent_bytes=4000)).stream_response(send), 5
    )
    assert send.body == b"".join(f"data: {i}\n\n".encode() for i in range(2000))
    assert send.messages[0]["type"] == "http.response.start" and send.messages[-1]["more_body"] is False


# -- `asyncengine serve` and raw sockets that stop reading --------------------------------------------
MAX_UNSENT = (
    256 * 1024
)  # small, so the tests are quick; a reader's burst of 200 requests still stays far under
STALL_S = 5.0
SLOW_REQUESTS = 300
LONG = {"max_tokens": 1000, "ignore_eos": True}  # far more output than the socket's buffers hold


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model: Path = chat_model(tmp_path_factory)
    srv = start_server(
        model,
        tmp_path_factory.mktemp("slow-reader"),
        "--num-threads",
        "1",
        "--max-unsent-bytes",
        str(MAX_UNSENT),
        "--send-stall-timeout",
        str(STALL_S),
    )
    yield srv
    stop(srv)


def rss_mb(srv: ServerProcess) -> float:
    """VmRSS of the server (engine) process, where unread output piles up: its outboxes and the engine's
    request queues. Not the workers': their KV cache is a lazily touched mmap, bounded by its size, whose
    RSS grows with the tokens generated however fast clients read."""
    status = Path(f"/proc/{srv.proc.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


def tiny_socket(srv: ServerProcess) -> socket.socket:
    """Connected, with a receive buffer so small that the server's sends back up after a few kilobytes."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: sets the window scale
    sock.settimeout(10)
    sock.connect((srv.host, srv.port))
    return sock


def not_reading_lines(srv: ServerProcess) -> int:
    return srv.log.read_text().count(NOT_READING)


def wait_dropped(
    srv: ServerProcess, lines_before: int, base_mb: float, timeout_s: float = 90
) -> tuple[float, float]:
    """Until the server logged dropping the client and no request is left; (seconds taken, peak RSS MB)."""
    t0, peak = time.monotonic(), base_mb
    while time.monotonic() - t0 < timeout_s:
        peak = max(peak, rss_mb(srv))
        if (
            not_reading_lines(srv) > lines_before
            and metric(srv, "num_requests_running") == 0
            and metric(srv, "num_requests_waiting") == 0
        ):
            return time.monotonic() - t0, peak
        time.sleep(0.25)
    raise AssertionError(
        f"the client was not dropped in {timeout_s}s: running "
        f"{metric(srv, 'num_requests_running')}, waiting {metric(srv, 'num_requests_waiting')}, "
        f"RSS {base_mb:.0f} -> {peak:.0f} MB"
    )


def other_client(srv: ServerProcess) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(
        f"{srv.base}/v1/completions",
        timeout=120,
        json={"prompt": "hello", "max_tokens": 8, "ignore_eos": True, "temperature": 0},
    )
    return r, time.monotonic() - t0


def check_other(pending: concurrent.futures.Future) -> float:
    r, took = pending.result(timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["finish_reason"] == "length"
    return took


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_websocket_client_that_never_reads_is_closed(server: ServerProcess) -> None:
    lines, aborts, base = not_reading_lines(server), metric(server, ABORTS), rss_mb(server)
    sock = tiny_socket(server)
    try:
        proto = ClientProtocol(parse_uri(server.ws_url))  # offers no compression: raw bytes fill the buffers
        proto.send_request(proto.connect())
        sock.sendall(b"".join(proto.data_to_send()))
        while proto.state is not State.OPEN:
            data = sock.recv(4096)
            assert data, "the server closed during the handshake"
            proto.receive_data(data)
        for i in range(SLOW_REQUESTS):
            proto.send_text(
                json.dumps(
                    {"type": "generate", "request_id": f"r{i}", "prompt": "hello " * 8, "params": LONG}
                ).encode()
            )
        sock.sendall(b"".join(proto.data_to_send()))  # ... and from here on, never a read
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(other_client, server)
            took, peak = wait_dropped(server, lines, base)
            other_took = check_other(other)
        assert metric(server, ABORTS) > aborts
        # the client reads again: behind what it had not read comes the close frame, with the reason
        deadline = time.monotonic() + 20
        while proto.close_rcvd is None and time.monotonic() < deadline:
            data = sock.recv(1 << 20)
            if not data:
                break
            proto.receive_data(data)
        assert proto.close_rcvd is not None, "no close frame"
        assert (proto.close_rcvd.code, proto.close_rcvd.reason) == (1008, NOT_READING)
    finally:
        sock.close()
    print(
        f"websocket slow reader: dropped after {took:.1f}s; RSS {base:.0f} -> peak {peak:.0f} MB; "
        f"other client's request {other_took:.1f}s"
    )
    assert peak - base < 64, f"RSS grew {peak - base:.0f} MB"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sse_client_that_never_reads_is_dropped(server: ServerProcess) -> None:
    lines, aborts, base = not_reading_lines(server), metric(server, ABORTS), rss_mb(server)
    sock = tiny_socket(server)
    try:
        # 50 prompts all start at once (SSE headers wait for every prompt's first output)
        body = json.dumps({"prompt": ["hello " * 8] * 50, "stream": True, **LONG}).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (server.host.encode(), server.port, len(body), body)
        )
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(other_client, server)
            took, peak = wait_dropped(server, lines, base)
            other_took = check_other(other)
        assert metric(server, ABORTS) > aborts
        # reading again, the client gets the rest, then the in-band error and the end of the response
        received, deadline = b"", time.monotonic() + 20
        while not received.endswith(b"0\r\n\r\n") and time.monotonic() < deadline:
            data = sock.recv(1 << 20)
            if not data:
                break
            received += data
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 200")
    assert NOT_READING.encode() in received[-2000:] and received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    print(
        f"SSE slow reader: dropped after {took:.1f}s; RSS {base:.0f} -> peak {peak:.0f} MB; "
        f"other client's request {other_took:.1f}s"
    )
    assert peak - base < 64, f"RSS grew {peak - base:.0f} MB"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_websocket_reader_with_a_burst_never_hits_the_bound(server: ServerProcess) -> None:
    lines = not_reading_lines(server)

    async def burst() -> dict[str, dict]:
        done: dict[str, dict] = {}
        async with connect(server.ws_url, open_timeout=20) as ws:
            for i in range(200):
                await ws.send(
                    json.dumps(
                        {
                            "type": "generate",
                            "request_id": f"b{i}",
                            "prompt": "hello",
                            "params": {"max_tokens": 32, "ignore_eos": True},
                        }
                    )
                )
            while len(done) < 200:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
                assert frame["type"] in ("delta", "done"), frame
                if frame["type"] == "done":
                    done[frame["request_id"]] = frame
        return done

    done = asyncio.run(asyncio.wait_for(burst(), 180))
    assert {f["finish_reason"] for f in done.values()} == {"length"}
    assert {f["usage"]["completion_tokens"] for f in done.values()} == {32}
    assert not_reading_lines(server) == lines
