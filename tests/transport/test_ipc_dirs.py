"""Stale ipc directories: a SIGKILLed engine leaves its asyncengine-PID-* directory behind; the next engine
removes it, and never one whose engine is alive (pid alive, or a listener on its broadcast socket)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import zmq

from asyncengine.transport.channels import BroadcastSender, Endpoints, remove_stale_ipc_dirs

pytestmark = pytest.mark.timeout(60)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make_dir(tmp: Path, name: str) -> Path:
    path = tmp / name
    path.mkdir(mode=0o700)
    (path / "results").write_text("")  # stands in for a socket file
    return path


def test_removes_only_dead_engines_dirs(tmp_path: Path) -> None:
    dead, live = dead_pid(), os.getpid()
    stale = make_dir(tmp_path, f"asyncengine-{dead}-abc_1234")
    kept = {
        "live owner": make_dir(tmp_path, f"asyncengine-{live}-xyz98765"),
        "older name, no pid": make_dir(tmp_path, "asyncengine-k2j4h5g6"),
        "older name, digits only": make_dir(tmp_path, "asyncengine-12345678"),
        "not ours by prefix": make_dir(tmp_path, f"other-{dead}-abc"),
    }
    # a dead pid but a listening broadcast socket: an engine in another pid namespace sharing /tmp
    listened = make_dir(tmp_path, f"asyncengine-{dead}-listen00")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(listened / "broadcast"))
    listener.listen()
    kept["listener on broadcast"] = listened
    (tmp_path / f"asyncengine-{dead}-plainfile").write_text("")  # not a directory
    (tmp_path / f"asyncengine-{dead}-symlink0").symlink_to(kept["live owner"])
    try:
        assert remove_stale_ipc_dirs(str(tmp_path)) == [stale]
    finally:
        listener.close()
    assert not stale.exists()
    assert all(p.is_dir() for p in kept.values()), {k: p.exists() for k, p in kept.items()}
    assert (tmp_path / f"asyncengine-{dead}-plainfile").exists()
    assert (tmp_path / f"asyncengine-{dead}-symlink0").is_symlink() and kept["live owner"].is_dir()
    # a socket file left behind without a listener (the engine was killed): stale
    assert remove_stale_ipc_dirs(str(tmp_path)) == [listened]


def test_local_endpoints_name_their_owner_and_clean_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = make_dir(tmp_path, f"asyncengine-{dead_pid()}-abcdefgh")
    endpoints = Endpoints.local()
    directory = Path(endpoints.broadcast[len("ipc://") :]).parent
    assert directory.parent == tmp_path and directory.name.startswith(f"asyncengine-{os.getpid()}-")
    assert not stale.exists()
    assert remove_stale_ipc_dirs(str(tmp_path)) == []  # ours: alive


ENGINE = textwrap.dedent("""
    import sys, time, zmq
    from asyncengine.transport.channels import BroadcastSender, Endpoints
    endpoints = Endpoints.local()
    sender = BroadcastSender(zmq.Context(), endpoints)
    print(endpoints.broadcast[len("ipc://"):], flush=True)
    time.sleep(60)
""")


@pytest.mark.slow
def test_sigkilled_engines_dir_is_removed_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines' channels in subprocesses: the SIGKILLed one's directory goes, the live one's stays."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path
        )
        for _ in range(2)
    ]
    try:
        dirs = [Path(p.stdout.readline().strip()).parent for p in procs]
        assert all(d.is_dir() and d.parent == tmp_path for d in dirs), dirs
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        assert dirs[0].is_dir()  # what a SIGKILLed server leaves behind
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        ctx = zmq.Context()
        sender = BroadcastSender(ctx, Endpoints.local())  # what the next engine does first
        sender.close()
        ctx.term()
        assert not dirs[0].exists() and dirs[1].is_dir()
    finally:
        for p in procs:
            p.kill()
            p.wait()
