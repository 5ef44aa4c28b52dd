"""ZeroMQ channels bound to one codec each: the engine's broadcast and the workers' result channel.

Engine:  BroadcastSender (XPUB, bind)   -> every worker's BroadcastReceiver (SUB, connect)
Workers: ResultSender (PUSH, connect)   -> the engine's ResultReceiver (PULL, bind)

XPUB tells the engine when each worker's subscription has arrived, so the first message is never
lost to PUB/SUB's "slow joiner" race, and (XPUB_VERBOSER) when one goes away: a worker whose
connection drops, on this host or another, is dead to the engine at once. Every receive is bounded
in size (MAXMSGSIZE) and in time.

Liveness: the broadcast socket sends ZeroMQ (ZMTP) heartbeat pings on every transport and drops a
connection whose peer leaves them unanswered for the heartbeat timeout, which the engine then sees
as an unsubscription. The worker's ZeroMQ I/O thread answers the pings, without the GIL, so a worker
busy in a long step stays alive, while a frozen one (SIGSTOP stops all its threads) or a vanished
node does not.

Several nodes: the head binds TCP (broadcast on PORT, results on PORT + 1) with CURVE, and ZeroMQ
heartbeats also let a worker notice a head that vanished without closing its connection.

Local runs: the sockets live in a private directory under the temp dir named after the engine's pid,
asyncengine-PID-XXXXXXXX; a new engine removes those whose process is gone (a SIGKILLed server cannot
remove its own).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.utils.monitor

from asyncengine.transport.codec import Codec, engine_codec, worker_codec
from asyncengine.transport.wire import EngineMessage, WorkerMessage

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
HEARTBEAT_IVL_MS = 1000  # a worker over TCP: ping the head every second ...
HEARTBEAT_TIMEOUT_MS = 10_000  # ... and drop the connection when it has been silent this long
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0  # the engine's side: EngineConfig.heartbeat_timeout
IPC_DIR_PREFIX = "asyncengine-"
# asyncengine-PID-XXXXXXXX; mkdtemp's random part never holds a "-", so older names never match
_IPC_DIR_NAME = re.compile(rf"{IPC_DIR_PREFIX}(\d+)-[^-]+")
_AUTH_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)
_LINK_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class ChannelTimeout(TimeoutError):
    """Nothing arrived within the bound."""


@dataclass(frozen=True)
class CurveKeys:
    """ZeroMQ CURVE keys (Z85 bytes): the server's pair, and a client pair for connectors."""

    server_public: bytes
    server_secret: bytes | None = None
    client_public: bytes | None = None
    client_secret: bytes | None = None


@dataclass(frozen=True)
class Endpoints:
    broadcast: str
    results: str
    curve: CurveKeys | None = None

    @classmethod
    def local(cls, ipc_dir: str | None = None) -> Endpoints:
        """ipc:// sockets in a private (0700) directory; mkdtemp creates it with that mode. A fresh
        directory is named after this process (its owner), once those of dead engines are removed."""
        if ipc_dir is None:
            remove_stale_ipc_dirs()
            ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")
        os.chmod(ipc_dir, 0o700)
        return cls(
            broadcast=f"ipc://{Path(ipc_dir) / 'broadcast'}", results=f"ipc://{Path(ipc_dir) / 'results'}"
        )

    @classmethod
    def tcp(cls, host: str, port: int, curve: CurveKeys | None) -> Endpoints:
        """The head's TCP layout: the step broadcast on `port`, the results on `port + 1`."""
        host = f"[{host}]" if ":" in host else host  # IPv6 literal
        return cls(broadcast=f"tcp://{host}:{port}", results=f"tcp://{host}:{port + 1}", curve=curve)

    @property
    def is_tcp(self) -> bool:
        return self.broadcast.startswith("tcp://")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; no pid we wrote: leave it alone
        pass
    return True


def _listening(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket at `path` (a live engine's XPUB)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:  # a timeout, a path too long: not provably dead
            pass
    return True


def remove_stale_ipc_dirs(tmp_dir: str | None = None) -> list[Path]:
    """Removes this user's asyncengine-PID-* directories whose process is gone and whose broadcast
    socket has no listener (a SIGKILLed server leaves its directory behind); returns them. Names
    without a pid (older versions) are left alone: they may belong to a live engine."""
    removed = []
    uid = os.getuid()
    for path in Path(tmp_dir or tempfile.gettempdir()).glob(f"{IPC_DIR_PREFIX}*"):
        match = _IPC_DIR_NAME.fullmatch(path.name)
        try:
            if match is None or not stat.S_ISDIR((st := path.lstat()).st_mode) or st.st_uid != uid:
                continue
        except OSError:
            continue
        pid = int(match.group(1))
        # NOTE: a reused pid keeps a dead engine's directory (a leak, never a live engine's loss); the
        # socket probe guards an engine in another pid namespace (a container sharing /tmp)
        if _pid_alive(pid) or _listening(path / "broadcast"):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            logger.info("removed %s, left behind by engine pid %d", path, pid)
    return removed


def _heartbeat(sock: zmq.Socket, endpoint: str) -> None:
    if endpoint.startswith("tcp://"):
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def _liveness_pings(sock: zmq.Socket, endpoint: str, timeout_s: float) -> None:
    """The engine's heartbeat, on any transport: a ping every tenth of the timeout, and a connection
    whose peer answers none of them for `timeout_s` is dropped (the XPUB then reports it)."""
    timeout_ms = max(100, int(timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(50, timeout_ms // 10))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    if endpoint.startswith("tcp://"):
        # tells a remote worker to drop a head it hears nothing from (local workers watch a death pipe,
        # and keep their connection through an engine paused by a debugger)
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(timeout_ms, 6_553_500))


def _secure_server(sock: zmq.Socket, curve: CurveKeys | None) -> None:
    if curve is not None:
        sock.curve_server = True
        sock.curve_secretkey = curve.server_secret
        sock.curve_publickey = curve.server_public


def _secure_client(sock: zmq.Socket, curve: CurveKeys | None) -> None:
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.client_public
        sock.curve_secretkey = curve.client_secret


class BroadcastSender:
    """The engine's side of the step broadcast: one send reaches every worker. A worker that leaves
    its heartbeat pings unanswered for `heartbeat_timeout_s` counts as unsubscribed."""

    def __init__(
        self, ctx: zmq.Context, endpoints: Endpoints, heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    ) -> None:
        self._codec: Codec[EngineMessage] = engine_codec()
        self._sock = ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a step because a worker is behind
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscription, duplicates included
        self._sock.setsockopt(zmq.XPUB_VERBOSER, 1)  # ... and every unsubscription: a dropped connection
        _liveness_pings(self._sock, endpoints.broadcast, heartbeat_timeout_s)
        _secure_server(self._sock, endpoints.curve)
        self._sock.bind(endpoints.broadcast)
        self.subscribers = 0
        self.unsubscribed = 0

    def wait_for_subscribers(self, count: int, timeout_s: float) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        deadline_ms = int(timeout_s * 1000)
        while self.subscribers < count:
            if not poller.poll(deadline_ms):
                raise ChannelTimeout(f"{self.subscribers} of {count} workers subscribed within {timeout_s}s")
            self._count(self._sock.recv())

    def _count(self, frame: bytes) -> None:
        if frame[:1] == b"\x01":
            self.subscribers += 1
        elif frame[:1] == b"\x00":
            self.unsubscribed += 1

    def poll_unsubscribed(self) -> int:
        """Counts the (un)subscriptions that arrived since the last call, without blocking; returns
        how many subscribers have gone away in all: a worker's connection dropped (it died)."""
        while self._sock.poll(0, zmq.POLLIN):
            self._count(self._sock.recv())
        return self.unsubscribed

    def send(self, message: EngineMessage) -> int:
        data = self._codec.encode(message)
        self._sock.send(data, copy=False)
        return len(data)

    def send_bytes(self, data: bytes) -> None:
        self._sock.send(data, copy=False)

    def encode(self, message: EngineMessage) -> bytes:
        return self._codec.encode(message)

    def close(self) -> None:
        self._sock.close(linger=0)


class ResultReceiver:
    """The engine's asyncio side of the result channel."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoints: Endpoints) -> None:
        self._codec: Codec[WorkerMessage] = worker_codec()
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        _heartbeat(self._sock, endpoints.results)
        _secure_server(self._sock, endpoints.curve)
        self._sock.bind(endpoints.results)

    async def recv(self, timeout_s: float | None) -> WorkerMessage:
        """Raises ChannelTimeout after timeout_s; msgspec errors on a malformed frame."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not await self._sock.poll(left_ms, zmq.POLLIN):
                raise ChannelTimeout(f"no worker message within {timeout_s}s")
            try:
                data = await self._sock.recv(copy=False)
            except zmq.Again:
                # NOTE: a TCP peer's CURVE handshake can make the socket look readable with nothing to
                # read (ZMQ_EVENTS says POLLIN, recv says EAGAIN): poll again
                continue
            return self._codec.decode(data.buffer)

    def close(self) -> None:
        self._sock.close(linger=0)


class BroadcastReceiver:
    """A worker's blocking side of the step broadcast."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints) -> None:
        self._codec: Codec[EngineMessage] = engine_codec()
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        _heartbeat(self._sock, endpoints.broadcast)
        _secure_client(self._sock, endpoints.curve)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        # over TCP nothing else tells a worker that the head is gone (no shared pipe): watch the link
        self._monitor = self._sock.get_monitor_socket(_LINK_EVENTS) if endpoints.is_tcp else None
        self._connected = False
        self._sock.connect(endpoints.broadcast)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._sock.poll(timeout_ms, zmq.POLLIN))

    def link_lost(self) -> str | None:
        """TCP only, non-blocking: why the link to the engine is gone (it was up and dropped, or the
        engine refused our keys), else None. ZeroMQ would silently reconnect; a worker must not."""
        while self._monitor is not None and self._monitor.poll(0, zmq.POLLIN):
            event = zmq.utils.monitor.parse_monitor_message(self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
            elif event in _AUTH_FAILED:
                return "the engine refused this worker's CURVE keys (a key file from another head?)"
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                return "the connection to the engine dropped"
        return None

    def recv_bytes(self) -> bytes:
        return self._sock.recv(copy=False).buffer

    def decode(self, data: bytes | memoryview) -> EngineMessage:
        return self._codec.decode(data)

    def close(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=0)


class ResultSender:
    """A worker's side of the result channel."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints) -> None:
        self._codec: Codec[WorkerMessage] = worker_codec()
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)  # let a final failure report reach the engine
        _heartbeat(self._sock, endpoints.results)
        _secure_client(self._sock, endpoints.curve)
        self._sock.connect(endpoints.results)

    def send(self, message: WorkerMessage) -> None:
        self._sock.send(self._codec.encode(message), copy=False)

    def close(self) -> None:
        self._sock.close()
