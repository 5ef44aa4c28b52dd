"""Worker processes on this machine: the command line that starts one, and a group of them tied to a
death pipe. The engine's executor (its node's ranks), `asyncengine worker` (another node's ranks) and a
Ray actor (the one rank it hosts) all start workers through here, so a worker is always the same program
started the same way: `python -m asyncengine.worker.main`, never an object pickled into a process.

The death pipe: the starter keeps the write end (not inheritable), every worker of the group gets the
read end (`--parent-fd`) and exits on EOF, so when the starter dies, however it dies, its workers go too.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from asyncengine.transport.channels import Endpoints
from asyncengine.transport.topology import worker_env

logger = logging.getLogger(__name__)


def worker_command(
    rank: int, local_rank: int, endpoints: Endpoints, parent_fd: int, extra: Sequence[str] = ()
) -> list[str]:
    """argv of one worker; `extra` adds flags such as --curve-keys FILE or --device-id N."""
    return [
        sys.executable,
        "-m",
        "asyncengine.worker.main",
        "--rank",
        str(rank),
        "--local-rank",
        str(local_rank),
        "--broadcast",
        endpoints.broadcast,
        "--results",
        endpoints.results,
        "--parent-fd",
        str(parent_fd),
        *extra,
    ]


class WorkerProcs:
    """Worker processes started together under one death pipe."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self._death_pipe_w: int | None = None

    def start(
        self,
        ranks: Sequence[tuple[int, int]],
        endpoints: Endpoints,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        world_size: int | None = None,
    ) -> None:
        """Starts one worker per (rank, local_rank), with `env` (default: this process's) less the
        launcher's own torchrun variables."""
        read_fd, write_fd = os.pipe()
        os.set_inheritable(read_fd, True)
        self._death_pipe_w = write_fd  # not inheritable: only this process holds it
        base = os.environ if env is None else env
        try:
            for rank, local in ranks:
                ids = {"RANK": rank, "LOCAL_RANK": local}
                if world_size is not None:
                    ids["WORLD_SIZE"] = world_size
                child_env = worker_env(base, **ids)
                child_env.setdefault("PYTHONUNBUFFERED", "1")
                cmd = worker_command(rank, local, endpoints, read_fd, extra)
                self.procs.append(
                    subprocess.Popen(cmd, pass_fds=(read_fd,), env=child_env, stdin=subprocess.DEVNULL)
                )
        finally:
            os.close(read_fd)

    def exited(self) -> tuple[int, int, int] | None:
        """(index, pid, exit code) of the first worker that has exited, if any."""
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                return i, p.pid, code
        return None

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def wait(self, timeout_s: float) -> None:
        """Waits up to timeout_s in all for the workers to exit on their own."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def terminate(self, grace_s: float = 3.0) -> None:
        """SIGTERM, then SIGKILL whatever is left after grace_s."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        self.wait(grace_s)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error("worker pid %d did not exit after SIGKILL", p.pid)

    def close(self) -> None:
        """Closes the death pipe: workers still running see EOF and exit."""
        if self._death_pipe_w is not None:
            os.close(self._death_pipe_w)
            self._death_pipe_w = None
