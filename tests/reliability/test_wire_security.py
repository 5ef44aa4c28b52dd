"""Wire and process security, beyond tests/transport (codec fuzz, CURVE) and test_no_pickle.py (AST scan):

* a worker fed garbage on its real broadcast socket drops each frame, logs it, and keeps serving;
* the ipc:// directory is private (0700, ours), and every receiving socket has a MAXMSGSIZE that holds;
* the decoders the workers and the engine use besides the two codecs (EngineConfig inside InitWorker,
  SamplingParams from client JSON, mutated worker messages) only raise typed errors;
* `asyncengine serve` (two workers, so the torch.distributed rendezvous too) listens on loopback only;
* the API key is compared in constant time.

The websocket frame bound (max_size, close 1009) is exercised by test_bad_input.py's ten_mb row, and
"a TCP peer without the CURVE keys receives nothing" by tests/transport/test_curve.py.
"""

from __future__ import annotations

import ast
import asyncio
import hmac
import ipaddress
import os
import random
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_helpers import ServerProcess, chat_model, children, start_server, stop

import asyncengine
from asyncengine import AsyncEngine, EngineConfig, SamplingParams, SamplingParamsError
from asyncengine.entrypoints.guard import api_key_ok
from asyncengine.transport import channels
from asyncengine.transport.codec import engine_codec, worker_codec
from asyncengine.transport.wire import (
    CachedSeq,
    CacheReady,
    ExecuteModelRequest,
    InitCache,
    InitWorker,
    ModelOutput,
    NewSeq,
    SamplingOptions,
    TokenLogprobs,
    WorkerFailure,
    WorkerReady,
    pack_ids,
)

pytestmark = pytest.mark.timeout(120)
PACKAGE = Path(asyncengine.__file__).resolve().parent
DROP_LOG = "dropped a malformed frame"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model(tmp_path_factory)


@pytest.fixture(scope="module")
def two_worker_server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Not waited for: the first slow test asks for it, so it loads while that test runs."""
    srv = start_server(model, tmp_path_factory.mktemp("wire"), "-pp", "2", "--num-threads", "1", wait=False)
    yield srv
    stop(srv)


# -- garbage on the real broadcast socket -----------------------------------------------------------
def real_engine_messages() -> list[bytes]:
    codec = engine_codec()
    step = ExecuteModelRequest(
        step_id=3,
        new_seqs=[NewSeq(9, pack_ids(list(range(40))), 40, [1, 2, 3], 0, 40, SamplingOptions())],
        cached_seqs=[CachedSeq(4, 1, [17], [8])],
        finished_seq_ids=[2],
    )
    return [codec.encode(m) for m in (step, InitCache(64), ExecuteModelRequest(step_id=4))]


def garbage_frames(rng: random.Random, count: int) -> list[bytes]:
    """Random bytes and byte-mutated real messages, keeping only frames the workers' codec rejects: a
    mutation that still decodes is a valid message (say, Shutdown), which a worker rightly obeys."""
    codec, real = engine_codec(), real_engine_messages()
    frames: list[bytes] = [b"", b"\x00", b"\xff" * 64, b"\x93\x01\x02"]  # empty, NUL, junk, a short array
    while len(frames) < count:
        if rng.random() < 0.5:
            data = bytearray(rng.choice(real))
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            frame = bytes(data)
        else:
            frame = rng.randbytes(rng.randint(1, 300))
        try:
            codec.decode(frame)
        except msgspec.MsgspecError:
            frames.append(frame)
    return frames


@pytest.mark.slow
async def test_worker_drops_garbage_frames_and_keeps_serving(
    model: Path, capfd: pytest.CaptureFixture, two_worker_server: ServerProcess
) -> None:
    # (two_worker_server is for the last test: asked for here so that it starts loading now)
    # started inside the test, so the worker inherits capfd's stderr and its log can be read
    engine = await AsyncEngine.start(
        EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, num_threads=1)
    )
    try:
        check_private_ipc_dir(engine)
        assert engine.executor.receiver._sock.getsockopt(zmq.MAXMSGSIZE) == channels.MAX_MESSAGE_BYTES > 0
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

        async def greedy() -> list[int]:
            return [o async for o in engine.generate("hello world", params)][-1].outputs[0].token_ids

        want = await greedy()
        frames = garbage_frames(random.Random(7), 120)
        for frame in frames[:60]:  # while idle
            engine.executor.sender.send_bytes(frame)
        stream = engine.generate("hello world", params)
        first = await anext(stream)
        for frame in frames[60:]:  # between the steps of a live request
            engine.executor.sender.send_bytes(frame)
        outs = [first] + [o async for o in stream]
        assert outs[-1].outputs[0].token_ids == want
        assert await greedy() == want and engine.is_running

        log = ""
        deadline = time.monotonic() + 10
        while log.count(DROP_LOG) < len(frames) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            log += capfd.readouterr().err
        assert log.count(DROP_LOG) == len(frames), log[-2000:]
    finally:
        await engine.shutdown()


def check_private_ipc_dir(engine: AsyncEngine) -> None:
    endpoints = engine.executor.endpoints
    assert endpoints.broadcast.startswith("ipc://") and endpoints.results.startswith("ipc://")
    directory = Path(endpoints.broadcast[len("ipc://") :]).parent
    assert Path(endpoints.results[len("ipc://") :]).parent == directory
    st_dir = directory.stat()
    assert stat.S_IMODE(st_dir.st_mode) == 0o700 and st_dir.st_uid == os.getuid(), oct(st_dir.st_mode)
    assert {p.name for p in directory.iterdir()} == {"broadcast", "results"}


# -- MAXMSGSIZE holds -------------------------------------------------------------------------------
async def test_receivers_drop_messages_over_maxmsgsize(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channels, "MAX_MESSAGE_BYTES", 4096)  # read when a socket is made
    endpoints = channels.Endpoints.local()
    sync_ctx, async_ctx = zmq.Context(), zmq.asyncio.Context()
    receiver = channels.ResultReceiver(async_ctx, endpoints)
    sender = channels.BroadcastSender(sync_ctx, endpoints)
    worker_rx = channels.BroadcastReceiver(sync_ctx, endpoints)
    worker_tx = channels.ResultSender(sync_ctx, endpoints)
    try:
        assert worker_rx._sock.getsockopt(zmq.MAXMSGSIZE) == 4096
        await asyncio.to_thread(sender.wait_for_subscribers, 1, 10.0)
        # engine <- worker: an oversized result never arrives (ZeroMQ drops the connection); the next one does
        worker_tx.send(ModelOutput(1, pack_ids(list(range(5000)))))  # 20 KB
        with pytest.raises(channels.ChannelTimeout):
            await receiver.recv(1.0)
        worker_tx.send(CacheReady(0))
        assert await receiver.recv(10.0) == CacheReady(0)
        # worker <- engine: an oversized broadcast never arrives either; the worker's link drops, which
        # the engine sees as an unsubscription (its liveness check then fails the engine: bounded)
        sender.send(ExecuteModelRequest(step_id=1, finished_seq_ids=list(range(5000))))
        assert not worker_rx.poll(1000)
        deadline = time.monotonic() + 10
        while not sender.poll_unsubscribed() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert sender.unsubscribed == 1
    finally:
        for sock in (receiver, sender, worker_rx, worker_tx):
            sock.close()
        sync_ctx.term()
        async_ctx.term()
        for name in ("broadcast", "results"):
            Path(getattr(endpoints, name)[len("ipc://") :]).unlink(missing_ok=True)
        Path(endpoints.broadcast[len("ipc://") :]).parent.rmdir()


# -- the other decoders on the process boundaries ----------------------------------------------------
def mutations(real: bytes, rng: random.Random, count: int) -> Iterator[bytes]:
    for _ in range(count):
        data = bytearray(real)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        yield bytes(data)


def test_mutated_worker_messages_fail_typed() -> None:
    """The engine's decoder of worker messages (tests/transport mutates only the engine's messages)."""
    codec, rng = worker_codec(), random.Random(11)
    real = [
        ModelOutput(5, pack_ids([1, 2, 3]), [TokenLogprobs([1, 4], [-0.5, -1.5], [1, 2]), None], 120),
        WorkerReady(1, 512, 4242, 32000),
        CacheReady(0),
        WorkerFailure(1, "RuntimeError: boom", "RuntimeError"),
    ]
    for message in real:
        for data in mutations(codec.encode(message), rng, 400):
            try:
                codec.decode(data)
            except msgspec.MsgspecError:
                pass


def test_init_worker_config_json_fails_typed(tmp_path: Path) -> None:
    """A worker decodes the EngineConfig inside InitWorker: bad JSON, types or values are typed errors."""
    real = msgspec.json.encode(EngineConfig(model=str(tmp_path)))
    assert msgspec.json.decode(real, type=EngineConfig).model == str(tmp_path)
    engine_codec().decode(engine_codec().encode(InitWorker(real, "tcp://127.0.0.1:1", 1)))
    for data in mutations(real, random.Random(3), 1500):
        try:
            msgspec.json.decode(data, type=EngineConfig)
        except msgspec.MsgspecError:
            pass


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)
FIELDS = st.sampled_from(sorted(SamplingParams.__struct_fields__) + ["bogus"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(FIELDS, JSON, max_size=6))
def test_sampling_params_from_client_json_fail_typed(fields: dict) -> None:
    """The server builds SamplingParams from client JSON: anything but a SamplingParamsError is a bug."""
    try:
        SamplingParams.from_dict(fields)
    except SamplingParamsError:
        pass


# -- API key ----------------------------------------------------------------------------------------
def test_api_key_compared_in_constant_time() -> None:
    key = "sk-secret"
    assert api_key_ok([(b"authorization", b"Bearer sk-secret")], key)
    for header in (b"Bearer sk-secreT", b"Bearer sk-secre", b"bearer", b"sk-secret", b""):
        assert not api_key_ok([(b"authorization", header)], key)
    # no ==, != or `in` on anything named like a key or secret anywhere in the package
    uses_digest = False
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                secret = {n for n in names if "api_key" in n.lower() or "secret" in n.lower()}
                bad = [op for op in node.ops if isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))]
                # `x is None` / `x is not None` checks are fine: they leak nothing about the value
                assert not (secret and bad), f"{path}:{node.lineno}: compares {secret} with {bad}"
            if isinstance(node, ast.Attribute) and node.attr == "compare_digest":
                uses_digest = True
    assert uses_digest and hmac.compare_digest


# -- listening sockets ------------------------------------------------------------------------------
def listening_tcp() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket on the host, from /proc/net."""
    found = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found[int(fields[9])] = (socket.inet_ntop(family, raw), int(port, 16))
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@pytest.mark.slow
def test_server_and_workers_listen_on_loopback_only(two_worker_server: ServerProcess) -> None:
    """Default --host: the HTTP listener, and the workers' torch.distributed rendezvous and gloo links."""
    srv = two_worker_server
    srv.wait_ready()
    listening = listening_tcp()
    seen: dict[int, list[tuple[str, int]]] = {}
    for pid in [srv.proc.pid, *children(srv.proc.pid)]:
        seen[pid] = [listening[i] for i in socket_inodes(pid) if i in listening]
    assert (srv.host, srv.port) in seen[srv.proc.pid], seen
    workers = [pid for pid in seen if pid != srv.proc.pid]
    assert len(workers) >= 2 and any(seen[w] for w in workers), seen  # two stages: gloo listens
    wide = {pid: [a for a in addrs if not is_loopback(a[0])] for pid, addrs in seen.items()}
    assert not any(wide.values()), f"listening beyond loopback: {wide}"
