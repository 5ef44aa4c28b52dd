"""Helpers for tests that run `asyncengine serve` as a subprocess: start, wait for the URL line, kill,
inspect."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "sk-test-key"
NUM_KV_BLOCKS = 256
START_TIMEOUT_S = 120.0
URL_LINE = re.compile(r"on http://([\d.]+):(\d+) ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Every descendant of `pid`, from /proc/*/stat (field 4 is the parent pid)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"  # a zombie has exited


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log: Path
    host: str = ""
    port: int = 0
    stdout_lines: list[str] | None = None

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}/v1/ws"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Waits for the one URL line on stdout, then drains stdout in the background."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        buf = ""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096).decode()
                if not chunk:
                    break
                buf += chunk
                m = URL_LINE.search(buf)
                if m:
                    self.host, self.port = m.group(1), int(m.group(2))
                    self.stdout_lines = buf.splitlines()
                    threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                    return
            elif self.proc.poll() is not None:
                break
        self.kill()
        raise RuntimeError(
            f"server did not start; stdout={buf!r}\nstderr tail:\n{self.log.read_text()[-3000:]}"
        )

    def kill(self) -> None:
        """SIGKILL to the whole process group: the server and its workers (test cleanup only)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def start_server(
    model: Path, tmp: Path, *args: str, port: int = 0, wait: bool = True, env: dict[str, str] | None = None
) -> ServerProcess:
    log = tmp / f"server-{time.monotonic_ns()}.log"
    cmd = [
        sys.executable,
        "-m",
        "asyncengine",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        *args,
    ]
    # cwd=tmp: the repository root would shadow the installed `asyncengine.cuda`/`transport` (docs/design.md)
    with log.open("w") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            cwd=tmp,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    server = ServerProcess(proc, log)
    if wait:
        server.wait_ready()
    return server


def metric(server: ServerProcess, name: str) -> float:
    """One sample from the server's /metrics (0 when absent, e.g. a counter never incremented)."""
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    # the model_name label every sample carries is left out: `name` is the metric and its other labels
    text = re.sub(r'\{model_name="[^"]*"\}', "", text)
    text = re.sub(r',?model_name="[^"]*"', "", text).replace("{,", "{")
    found = re.search(rf"^asyncengine:{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


ABORTS = 'request_success_total{finished_reason="abort"}'
LENGTHS = 'request_success_total{finished_reason="length"}'


def wait_aborted(server: ServerProcess, aborts_before: float, timeout_s: float = 20.0) -> float:
    """Until one more request was aborted and every KV block is free again; returns the abort count."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        aborts = metric(server, ABORTS)
        if (
            aborts > aborts_before
            and metric(server, "kv_cache_free_blocks") == NUM_KV_BLOCKS
            and metric(server, "num_requests_running") == 0
        ):
            return aborts
        time.sleep(0.1)
    raise AssertionError(
        f"no abort, or KV blocks not freed: {metric(server, 'kv_cache_free_blocks')} of "
        f"{NUM_KV_BLOCKS}, aborts {metric(server, ABORTS)} (before {aborts_before})"
    )
