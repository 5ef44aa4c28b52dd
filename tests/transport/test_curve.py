"""CURVE + ZAP on the head's TCP sockets: only the key file's client gets in.

A peer without the key file's secret can neither read the step broadcast nor push results, and is
never counted as a subscriber; a worker refused by the head notices (and exits instead of waiting).
"""

from __future__ import annotations

import asyncio
import socket
import stat
import time
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio

from asyncengine.transport.channels import (
    BroadcastReceiver,
    BroadcastSender,
    ChannelTimeout,
    CurveKeys,
    Endpoints,
    ResultReceiver,
    ResultSender,
)
from asyncengine.transport.codec import worker_codec
from asyncengine.transport.curve import (
    ClientAllowlist,
    KeyFileError,
    generate_keys,
    load_client_keys,
    write_key_file,
)
from asyncengine.transport.wire import CacheReady, Shutdown

pytestmark = pytest.mark.timeout(60)


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the head's broadcast and result ports)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port pair")


def test_key_file_is_private_and_round_trips(tmp_path) -> None:
    keys = generate_keys()
    path = write_key_file(keys, tmp_path / "keys.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "server_secret" not in path.read_text() and keys.server_secret.decode() not in path.read_text()
    loaded = load_client_keys(path)
    assert (loaded.server_public, loaded.client_public, loaded.client_secret) == (
        keys.server_public,
        keys.client_public,
        keys.client_secret,
    )
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(KeyFileError):
        load_client_keys(tmp_path / "bad.json")
    with pytest.raises(KeyFileError):
        load_client_keys(tmp_path / "missing.json")


@pytest.fixture
def head() -> Iterator[tuple[Endpoints, BroadcastSender, ResultReceiver]]:
    keys = generate_keys()
    endpoints = Endpoints.tcp("127.0.0.1", free_port_pair(), keys)
    ctx, actx = zmq.Context(), zmq.asyncio.Context()
    auth = [ClientAllowlist(c, [keys.client_public]) for c in (ctx, actx)]
    sender, receiver = BroadcastSender(ctx, endpoints), ResultReceiver(actx, endpoints)
    yield endpoints, sender, receiver
    sender.close()
    receiver.close()
    for a in auth:
        a.stop()
    ctx.term()
    actx.term()


def raw_push(ctx: zmq.Context, endpoint: str, curve: CurveKeys | None) -> zmq.Socket:
    """An intruder's PUSH socket, sending without blocking."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            curve.server_public,
            curve.client_public,
            curve.client_secret,
        )
    sock.connect(endpoint)
    return sock


def client_endpoints(endpoints: Endpoints, curve: CurveKeys | None) -> Endpoints:
    return Endpoints(endpoints.broadcast, endpoints.results, curve)


async def test_only_the_key_file_client_gets_in(head) -> None:
    endpoints, sender, receiver = head
    keys = endpoints.curve
    stranger_public, stranger_secret = zmq.curve_keypair()
    fake_server, _ = zmq.curve_keypair()
    intruders = {
        "no CURVE": None,
        "unknown client key": CurveKeys(keys.server_public, None, stranger_public, stranger_secret),
        "wrong server key": CurveKeys(fake_server, None, stranger_public, stranger_secret),
        "stolen public key, wrong secret": CurveKeys(
            keys.server_public, None, keys.client_public, stranger_secret
        ),
    }
    good_keys = CurveKeys(keys.server_public, None, keys.client_public, keys.client_secret)
    ctx = zmq.Context()
    try:
        bad_rx = {
            name: BroadcastReceiver(ctx, client_endpoints(endpoints, c)) for name, c in intruders.items()
        }
        bad_tx = {name: raw_push(ctx, endpoints.results, c) for name, c in intruders.items()}
        await asyncio.sleep(0.5)  # give the intruders every chance to connect first
        good_rx = BroadcastReceiver(ctx, client_endpoints(endpoints, good_keys))
        good_tx = ResultSender(ctx, client_endpoints(endpoints, good_keys))
        await asyncio.to_thread(sender.wait_for_subscribers, 1, 10.0)
        await asyncio.sleep(0.5)
        sender.poll_unsubscribed()
        assert sender.subscribers == 1  # intruders never subscribed

        sender.send(Shutdown())
        assert good_rx.poll(5000) and isinstance(good_rx.decode(good_rx.recv_bytes()), Shutdown)
        for name, rx in bad_rx.items():
            assert not rx.poll(200), f"{name} received a broadcast"

        for rank, tx in enumerate(bad_tx.values()):
            try:  # a refused peer has no connection: the PUSH cannot even queue (EAGAIN)
                tx.send(worker_codec().encode(CacheReady(100 + rank)), zmq.NOBLOCK)
            except zmq.Again:
                pass
        with pytest.raises(ChannelTimeout):
            await receiver.recv(1.0)  # nothing injected
        good_tx.send(CacheReady(0))
        assert await receiver.recv(5.0) == CacheReady(0)

        # a refused worker learns it (and exits) instead of waiting for a broadcast forever
        refused = bad_rx["unknown client key"]
        why, deadline = refused.link_lost(), time.monotonic() + 5
        while why is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            why = refused.link_lost()
        assert why is not None and "refused" in why
        assert good_rx.link_lost() is None
    finally:
        for sock in [*bad_rx.values(), good_rx, good_tx]:
            sock.close()
        for raw in bad_tx.values():
            raw.close(linger=0)
        ctx.term()


async def test_worker_disconnect_is_reported(head) -> None:
    endpoints, sender, _ = head
    keys = endpoints.curve
    ctx = zmq.Context()
    rx = BroadcastReceiver(
        ctx,
        client_endpoints(
            endpoints, CurveKeys(keys.server_public, None, keys.client_public, keys.client_secret)
        ),
    )
    await asyncio.to_thread(sender.wait_for_subscribers, 1, 10.0)
    assert sender.poll_unsubscribed() == 0
    rx.close()
    ctx.term()
    deadline = time.monotonic() + 5
    while sender.poll_unsubscribed() == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert sender.poll_unsubscribed() == 1
