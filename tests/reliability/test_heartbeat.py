"""Worker liveness heartbeat: a frozen worker (SIGSTOP) makes the engine dead within the heartbeat timeout,
idle or mid-step, far below step_timeout; a worker busy in a long step (a C call holding the GIL) does not.

The engine's broadcast socket pings every worker (ZeroMQ heartbeats, answered by the worker's ZeroMQ I/O
thread); a connection left unanswered for `heartbeat_timeout` is dropped and the engine sees it as an
unsubscription (transport/channels.py). Every test SIGCONTs / SIGKILLs what it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from reliability_helpers import alive, chat_model, start_server, stop, worker_pids

from asyncengine import AsyncEngine, EngineConfig, EngineDeadError, SamplingParams
from asyncengine.transport.channels import BroadcastSender, Endpoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

DEFAULT_HEARTBEAT_S = EngineConfig.__dataclass_fields__["heartbeat_timeout"].default
# the timeout, then up to one ping interval (a tenth of it) and one liveness poll (0.5 s), plus CPU slack
SLACK_S = 3.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model(tmp_path_factory)  # 1024 positions: 64 blocks of 16


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """SIGSTOPs `pid`; on exit SIGCONTs it (a no-op once the engine has SIGKILLed it)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def wait_dead(engine: AsyncEngine, timeout_s: float) -> float:
    t0 = time.monotonic()
    while engine.dead is None and time.monotonic() - t0 < timeout_s:
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


# -- the channel alone -----------------------------------------------------------------------------
SUBSCRIBER = textwrap.dedent("""
    import ctypes, sys, time, zmq
    from asyncengine.transport.channels import BroadcastReceiver, Endpoints
    rx = BroadcastReceiver(zmq.Context(), Endpoints(sys.argv[1], sys.argv[2]))
    time.sleep(0.5)
    if sys.argv[3] == "busy":  # one C call that holds the GIL (PyDLL does not release it), as a long step may
        ctypes.PyDLL(None).sleep(6)
    time.sleep(60)
""")


def test_channel_drops_frozen_subscriber_keeps_busy_one(tmp_path: Path) -> None:
    ctx = zmq.Context()
    endpoints = Endpoints.local()
    sender = BroadcastSender(ctx, endpoints, heartbeat_timeout_s=1.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SUBSCRIBER, endpoints.broadcast, endpoints.results, role], cwd=tmp_path
        )
        for role in ("busy", "frozen")
    ]
    try:
        sender.wait_for_subscribers(2, 60)
        with frozen(procs[1].pid):
            t0 = time.monotonic()
            while sender.poll_unsubscribed() == 0 and time.monotonic() - t0 < 10:
                time.sleep(0.02)
            latency = time.monotonic() - t0
            assert sender.unsubscribed == 1, "the frozen subscriber was never dropped"
            assert latency < 1.0 + 1.5, latency
            time.sleep(3.0)  # the busy one holds its GIL for 6 s: 3x the timeout and more
            assert sender.poll_unsubscribed() == 1 and procs[0].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()
        sender.close()
        ctx.term()
        shutil.rmtree(Path(endpoints.broadcast[len("ipc://") :]).parent, ignore_errors=True)


# -- the engine ------------------------------------------------------------------------------------
async def test_frozen_idle_worker_makes_engine_dead(model: Path) -> None:
    engine = await AsyncEngine.start(
        EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, num_threads=1)
    )
    pid = engine.executor.procs[0].pid
    try:
        out = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))]
        assert out[-1].finished
        with frozen(pid):
            elapsed = await wait_dead(engine, DEFAULT_HEARTBEAT_S + 15)
            assert engine.dead is not None, f"a frozen idle worker went unnoticed for {elapsed:.1f}s"
        print(f"idle detection: {elapsed:.2f}s (heartbeat_timeout {DEFAULT_HEARTBEAT_S}s)")
        assert elapsed < DEFAULT_HEARTBEAT_S + SLACK_S, elapsed
        assert "heartbeat" in str(engine.dead)
        assert not engine.is_running and engine.executor.procs[0].poll() is not None  # SIGKILLed
        with pytest.raises(EngineDeadError):
            engine.add_request([1, 2, 3], SamplingParams())
    finally:
        await engine.shutdown()


async def test_frozen_busy_worker_fails_requests_before_step_timeout(model: Path) -> None:
    engine = await AsyncEngine.start(
        EngineConfig(model=str(model), dtype="float32", num_kv_blocks=256, num_threads=1, step_timeout=60.0)
    )
    pid = engine.executor.procs[0].pid
    first = asyncio.Event()

    async def one(i: int) -> BaseException | None:
        try:
            async for _ in engine.generate([5 + i, 6, 7], SamplingParams(max_tokens=900, ignore_eos=True)):
                first.set()
        except EngineDeadError as e:
            return e
        return None

    try:
        task = asyncio.gather(*(one(i) for i in range(4)))
        await asyncio.wait_for(first.wait(), 60)
        with frozen(pid):
            t0 = time.monotonic()
            results = await asyncio.wait_for(task, DEFAULT_HEARTBEAT_S + 20)
            elapsed = time.monotonic() - t0
        print(f"busy detection: {elapsed:.2f}s (heartbeat_timeout {DEFAULT_HEARTBEAT_S}s, step_timeout 60s)")
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert elapsed < DEFAULT_HEARTBEAT_S + SLACK_S, elapsed
        assert "heartbeat" in str(results[0])
    finally:
        await engine.shutdown()


SLOW_STEP_HOOK = textwrap.dedent("""
    # sitecustomize for the test's worker processes: the first prefill step holds the GIL for N seconds
    import os
    _seconds = int(os.environ.get("HEARTBEAT_TEST_SLOW_STEP_S", "0"))
    if _seconds:
        import ctypes
        from asyncengine.worker import worker as _worker
        _execute, _slowed = _worker.Worker.execute_model, []

        def execute_model(self, req):
            if req.new_seqs and not _slowed:
                _slowed.append(True)
                ctypes.PyDLL(None).sleep(_seconds)  # a C call that keeps the GIL, as a long step may
            return _execute(self, req)

        _worker.Worker.execute_model = execute_model
""")


async def test_long_step_is_not_a_freeze(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sitecustomize.py").write_text(SLOW_STEP_HOOK)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("HEARTBEAT_TEST_SLOW_STEP_S", "4")
    engine = await AsyncEngine.start(
        EngineConfig(
            model=str(model), dtype="float32", num_kv_blocks=64, num_threads=1, heartbeat_timeout=1.0
        )
    )
    try:
        t0 = time.monotonic()
        outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))]
        elapsed = time.monotonic() - t0
        assert len(outs[-1].outputs[0].token_ids) == 8 and outs[-1].finished
        assert elapsed >= 4.0, f"the slow-step hook did not run ({elapsed:.1f}s)"
        assert engine.dead is None and engine.is_running
    finally:
        await engine.shutdown()


# -- the server ------------------------------------------------------------------------------------
def test_server_health_503_soon_after_idle_worker_freezes(model: Path, tmp_path: Path) -> None:
    """Through `asyncengine serve --heartbeat-timeout 2 --restart-workers`: /health turns 503, then the
    frozen worker is replaced and /health is 200 again."""
    srv = start_server(model, tmp_path, "--heartbeat-timeout", "2", "--restart-workers", "--num-threads", "1")
    try:
        (pid,) = worker_pids(srv.proc.pid)
        with frozen(pid):
            t0 = time.monotonic()
            while (status := httpx.get(f"{srv.base}/health", timeout=5).status_code) == 200:
                if time.monotonic() - t0 > 20:
                    break
                time.sleep(0.05)
            elapsed = time.monotonic() - t0
            assert status == 503, f"/health stayed 200 for {elapsed:.1f}s:\n{srv.log.read_text()[-3000:]}"
        print(f"server /health 503 after {elapsed:.2f}s (heartbeat_timeout 2s)")
        assert elapsed < 2.0 + SLACK_S, elapsed
        deadline = time.monotonic() + 120
        while httpx.get(f"{srv.base}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, srv.log.read_text()[-3000:]
            time.sleep(0.2)
        assert not alive(pid) and worker_pids(srv.proc.pid) != [pid]
        assert "heartbeat" in srv.log.read_text()
    finally:
        stop(srv)


# -- another node ----------------------------------------------------------------------------------
def free_port_pair() -> int:
    """A port p with p and p + 1 free (the head's broadcast and result ports)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with contextlib.suppress(OSError), socket.socket() as b:
                b.bind(("127.0.0.1", port + 1))
                return port
    raise RuntimeError("no free port pair")


async def test_frozen_remote_worker_over_tcp(model: Path, tmp_path: Path) -> None:
    """nnodes=2 on loopback (TCP + CURVE): node 1's worker, frozen while the engine is idle, is noticed
    through the same heartbeat; no process handle of it exists on the head."""
    port, key_file = free_port_pair(), tmp_path / "keys.json"
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        pipeline_parallel_size=2,
        nnodes=2,
        head_port=port,
        key_file=str(key_file),
        num_threads=1,
        num_kv_blocks=64,
        max_model_len=128,
        heartbeat_timeout=2.0,
    )
    starting = asyncio.create_task(AsyncEngine.start(config))
    launcher, remote = None, []
    try:
        for _ in range(1200):
            if key_file.exists() or starting.done():
                break
            await asyncio.sleep(0.05)
        assert key_file.exists(), starting.exception() if starting.done() else "no key file"
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "asyncengine.entrypoints.worker_cli",
                "--head",
                f"127.0.0.1:{port}",
                "--node-rank",
                "1",
                "--key-file",
                str(key_file),
                "--nproc",
                "1",
            ],
            stdin=subprocess.DEVNULL,
        )
        engine = await asyncio.wait_for(starting, 120)
        try:
            out = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))]
            assert out[-1].finished
            remote = worker_pids(launcher.pid)
            assert len(remote) == 1
            with frozen(remote[0]):
                elapsed = await wait_dead(engine, 20)
                assert engine.dead is not None, f"a frozen remote worker went unnoticed for {elapsed:.1f}s"
            print(f"remote (tcp) idle detection: {elapsed:.2f}s (heartbeat_timeout 2s)")
            assert elapsed < 2.0 + SLACK_S, elapsed
            assert "heartbeat" in str(engine.dead)
        finally:
            await engine.shutdown()
    finally:
        if not starting.done():
            starting.cancel()
        for pid in remote:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher is not None:
            launcher.kill()
            launcher.wait()
