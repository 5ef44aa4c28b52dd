"""Shared by the reliability tests: one tiny chat model per session, the `asyncengine serve` subprocess
helpers of tests/asyncengine/entrypoints/server_process.py (and the fake engine of fake_engine.py there),
and worker-process lookup via /proc."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import build_tiny_model_with_tokenizer

_ENTRYPOINT_TESTS = Path(__file__).resolve().parents[1] / "asyncengine" / "entrypoints"


def _load_entrypoint_helper(name: str):  # noqa: ANN202 - a module
    # NOTE: loaded by path (tests/asyncengine/entrypoints is not a package, nor on sys.path from here);
    # reuse the module if the entrypoint tests already imported it, so both share one set of helpers
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _ENTRYPOINT_TESTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


server_process = _load_entrypoint_helper("server_process")
FakeEngine = _load_entrypoint_helper("fake_engine").FakeEngine
ServerProcess = server_process.ServerProcess
start_server = server_process.start_server
alive = server_process.alive
children = server_process.children

_models: dict[tuple, Path] = {}


def chat_model(tmp_path_factory: pytest.TempPathFactory, **overrides: int) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer, built once per session per set of overrides."""
    key = tuple(sorted(overrides.items()))
    if key not in _models:
        _models[key] = build_tiny_model_with_tokenizer(
            "llama", tmp_path_factory.mktemp("rel-model"), **overrides
        )
    return _models[key]


def worker_pids(server_pid: int) -> list[int]:
    """The live `asyncengine.worker.main` processes under a server, in rank order."""
    found = []
    for pid in children(server_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"asyncengine.worker.main" in argv and alive(pid):
            rank = int(argv[argv.index(b"--rank") + 1])
            found.append((rank, pid))
    return [pid for _, pid in sorted(found)]


def stop(srv: ServerProcess, timeout_s: float = 15.0) -> None:
    """SIGTERM first, so the server shuts its engine down and removes its ipc directory; SIGKILL after."""
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            srv.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    srv.kill()
