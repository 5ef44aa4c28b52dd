"""ZeroMQ channels bound to one codec each: the engine's broadcast and the workers' result channel.

Engine:  BroadcastSender (XPUB, bind)   -> every worker's BroadcastReceiver (SUB, connect)
Workers: ResultSender (PUSH, connect)   -> the engine's ResultReceiver (PULL, bind)

XPUB tells the engine when each worker's subscription has arrived, so the first message is never
lost to PUB/SUB's "slow joiner" race. Every receive is bounded in size (MAXMSGSIZE) and in time.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from asyncengine.transport.codec import Codec, engine_codec, worker_codec
from asyncengine.transport.wire import EngineMessage, WorkerMessage

MAX_MESSAGE_BYTES = 256 * 1024 * 1024


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
        """ipc:// sockets in a private (0700) directory; mkdtemp creates it with that mode."""
        directory = ipc_dir or tempfile.mkdtemp(prefix="asyncengine-")
        os.chmod(directory, 0o700)
        return cls(broadcast=f"ipc://{Path(directory) / 'broadcast'}", results=f"ipc://{Path(directory) / 'results'}")


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
    """The engine's side of the step broadcast: one send reaches every worker."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints) -> None:
        self._codec: Codec[EngineMessage] = engine_codec()
        self._sock = ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a step because a worker is behind
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscription, duplicates included
        _secure_server(self._sock, endpoints.curve)
        self._sock.bind(endpoints.broadcast)
        self.subscribers = 0

    def wait_for_subscribers(self, count: int, timeout_s: float) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        deadline_ms = int(timeout_s * 1000)
        while self.subscribers < count:
            if not poller.poll(deadline_ms):
                raise ChannelTimeout(f"{self.subscribers} of {count} workers subscribed within {timeout_s}s")
            frame = self._sock.recv()
            if frame[:1] == b"\x01":
                self.subscribers += 1

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
        _secure_server(self._sock, endpoints.curve)
        self._sock.bind(endpoints.results)

    async def recv(self, timeout_s: float | None) -> WorkerMessage:
        """Raises ChannelTimeout after timeout_s; msgspec errors on a malformed frame."""
        if timeout_s is not None and not await self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise ChannelTimeout(f"no worker message within {timeout_s}s")
        data = await self._sock.recv(copy=False)
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
        _secure_client(self._sock, endpoints.curve)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoints.broadcast)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._sock.poll(timeout_ms, zmq.POLLIN))

    def recv_bytes(self) -> bytes:
        return self._sock.recv(copy=False).buffer

    def decode(self, data: bytes | memoryview) -> EngineMessage:
        return self._codec.decode(data)

    def close(self) -> None:
        self._sock.close(linger=0)


class ResultSender:
    """A worker's side of the result channel."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints) -> None:
        self._codec: Codec[WorkerMessage] = worker_codec()
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)  # let a final failure report reach the engine
        _secure_client(self._sock, endpoints.curve)
        self._sock.connect(endpoints.results)

    def send(self, message: WorkerMessage) -> None:
        self._sock.send(self._codec.encode(message), copy=False)

    def close(self) -> None:
        self._sock.close()
