"""The `asyncengine` command: start-up errors, `generate`, and how `serve` shuts down (SIGTERM, SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from server_process import API_KEY, ServerProcess, alive, children, free_port, start_server
from websockets.sync.client import connect

pytestmark = pytest.mark.timeout(120)


def cli(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "asyncengine", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, stdin=subprocess.DEVNULL)


@dataclass
class Background:
    generate: subprocess.Popen
    term: ServerProcess  # for SIGTERM, on a known port (its /health is polled while it loads)
    term_port: int
    kill: ServerProcess  # for SIGKILL


@pytest.fixture(scope="module")
def background(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    """The slow processes, started at once so their start-ups overlap: a `generate` run and two servers."""
    tmp = tmp_path_factory.mktemp("cli")
    port = free_port()
    term = start_server(chat_model, tmp, "--shutdown-timeout", "1", port=port, wait=False)
    kill = start_server(chat_model, tmp, wait=False)
    gen = cli(tmp, "generate", "--model", str(chat_model), "--dtype", "float32", "--num-kv-blocks", "64",
              "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "hello world")
    yield Background(gen, term, port, kill)
    term.kill()
    kill.kill()
    gen.kill()
    gen.communicate()


def wait_exit(server: ServerProcess, timeout_s: float) -> int:
    try:
        return server.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        raise AssertionError(f"server still running after {timeout_s}s:\n{server.log.read_text()[-3000:]}") from None


@pytest.mark.slow
def test_health_while_loading_then_sigterm_drains_and_exits_clean(background: Background) -> None:
    srv, port = background.term, background.term_port
    seen_loading = False
    deadline = time.monotonic() + 60
    while not seen_loading and time.monotonic() < deadline and srv.proc.poll() is None:
        try:  # the server listens before the model is loaded, and says so
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            seen_loading = r.status_code == 503 and r.json() == {"status": "loading"}
        except httpx.TransportError:
            time.sleep(0.05)
    srv.wait_ready()
    assert seen_loading and srv.port == port
    assert httpx.get(f"{srv.base}/health").status_code == 200
    workers = children(srv.proc.pid)
    assert workers
    with connect(srv.ws_url, open_timeout=20) as ws:
        ws.send(json.dumps({"type": "generate", "request_id": "long", "prompt": "x",
                            "params": {"max_tokens": 1000, "ignore_eos": True}}))
        assert json.loads(ws.recv(30))["type"] == "delta"
        srv.proc.send_signal(signal.SIGTERM)
        # the request outlives the 1 s grace period, so the shutdown aborts it
        while (frame := json.loads(ws.recv(30)))["type"] == "delta":
            pass
        assert frame["type"] == "done" and frame["finish_reason"] == "abort"
    assert wait_exit(srv, 30) == 0
    assert not [pid for pid in workers if alive(pid)]


@pytest.mark.slow
def test_sigkill_leaves_no_worker(background: Background) -> None:
    srv = background.kill
    srv.wait_ready()
    workers = children(srv.proc.pid)
    assert workers
    os.kill(srv.proc.pid, signal.SIGKILL)  # only the server: its workers must notice on their own
    srv.proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)]


@pytest.mark.slow
def test_generate_streams_the_greedy_completion(background: Background, server: ServerProcess) -> None:
    want = httpx.post(f"{server.base}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": "hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
                      timeout=30).json()["choices"][0]["text"]
    out, err = background.generate.communicate(timeout=90)
    assert background.generate.returncode == 0, err
    assert out == want + "\n"


@pytest.mark.slow
def test_startup_errors(tmp_path: Path, chat_model: Path) -> None:
    """A bad model path, a taken port, more devices than exist: one line on stderr, non-zero exit."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = {  # run at once: each pays the interpreter's import time
            "model directory not found": ["--model", str(tmp_path / "missing"), "--port", "0"],
            f"cannot listen on 127.0.0.1:{port}": ["--model", str(chat_model), "--port", str(port),
                                                   "--device", "cpu"],
            "visible": ["--model", str(chat_model), "--port", "0",
                        *(["-tp", str(gpus + 1)] if gpus else ["--device", "cuda"])],
        }
        procs = {want: cli(tmp_path, "serve", *args) for want, args in cases.items()}
        results = {want: (p.communicate(timeout=90), p.returncode) for want, p in procs.items()}
    for want, ((out, err), code) in results.items():
        lines = [line for line in err.splitlines() if line.startswith("asyncengine: error:")]
        assert code == 1 and len(lines) == 1 and want in lines[0] and out == "", (want, err)
