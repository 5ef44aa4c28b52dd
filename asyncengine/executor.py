"""Executor: starts the worker processes, broadcasts each step's bytes once, collects results.

Workers are started by their entry point (`python -m asyncengine.worker.main`), never by pickling an
object into them. Each holds the read end of a pipe whose write end only this process has: when the
engine process dies, however it dies, the workers see EOF and exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError, EngineDeadError, ModelLoadError
from asyncengine.transport.channels import (
    BroadcastSender,
    ChannelTimeout,
    Endpoints,
    ResultReceiver,
)
from asyncengine.transport.process_group import free_port
from asyncengine.transport.wire import (
    CacheReady,
    EngineMessage,
    InitCache,
    InitWorker,
    ModelOutput,
    Shutdown,
    WorkerFailure,
    WorkerMessage,
    WorkerReady,
)

logger = logging.getLogger(__name__)

LIVENESS_POLL_S = 0.5

# worker-side exception names that mean "your model or settings are wrong", not "a worker crashed"
STARTUP_ERRORS: dict[str, type[Exception]] = {
    "ModelLoadError": ModelLoadError,
    "ConfigError": ConfigError,
    "KVCacheTooSmallError": ConfigError,
    "DeviceError": ConfigError,
}


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.world_size
        self.endpoints = Endpoints.local()
        self._ipc_dir = Path(self.endpoints.broadcast[len("ipc://"):]).parent
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self.sender = BroadcastSender(self._sync_ctx, self.endpoints)
        self.receiver = ResultReceiver(self._async_ctx, self.endpoints)
        self.procs: list[subprocess.Popen] = []
        self._death_pipe_w: int | None = None
        self.num_kv_blocks = 0
        self.vocab_size = 0
        self.dead_reason: str | None = None
        self.last_encode_bytes = 0
        self.failure: WorkerFailure | None = None

    # -- start-up ---------------------------------------------------------------------------------
    def _spawn(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_inheritable(read_fd, True)
        self._death_pipe_w = write_fd  # not inheritable: only this process holds it
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        for rank in range(self.world_size):
            cmd = [sys.executable, "-m", "asyncengine.worker.main", "--rank", str(rank),
                   "--broadcast", self.endpoints.broadcast, "--results", self.endpoints.results,
                   "--parent-fd", str(read_fd)]
            self.procs.append(subprocess.Popen(cmd, pass_fds=(read_fd,), env=env, stdin=subprocess.DEVNULL))
        os.close(read_fd)

    async def start(self, load_timeout_s: float = 900.0) -> None:
        """Raises ModelLoadError / ConfigError for a bad model or setting, EngineDeadError otherwise."""
        try:
            await self._start(load_timeout_s)
        except EngineDeadError:
            failure = self.failure
            if failure is not None and failure.error_type in STARTUP_ERRORS:
                raise STARTUP_ERRORS[failure.error_type](failure.message.split(": ", 1)[-1]) from None
            raise

    async def _start(self, load_timeout_s: float) -> None:
        self._spawn()
        try:
            await asyncio.to_thread(self.sender.wait_for_subscribers, self.world_size, 60.0)
        except ChannelTimeout as e:
            self._check_alive()
            raise EngineDeadError(f"workers did not connect: {e}") from None
        init_method = f"tcp://127.0.0.1:{free_port()}"
        config_json = msgspec.json.encode(self.config)
        self.sender.send(InitWorker(config_json, init_method, self.world_size))
        ready = await self._gather(WorkerReady, load_timeout_s)
        self.num_kv_blocks = min(r.num_kv_blocks for r in ready)
        self.vocab_size = ready[0].vocab_size
        self.sender.send(InitCache(self.num_kv_blocks))
        await self._gather(CacheReady, load_timeout_s)

    async def _gather(self, kind: type, timeout_s: float) -> list:
        got: dict[int, WorkerMessage] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            msg = await self.recv(deadline - time.monotonic())
            if isinstance(msg, kind):
                got[msg.rank] = msg  # type: ignore[attr-defined]
        return [got[r] for r in sorted(got)]

    # -- steps ------------------------------------------------------------------------------------
    def send(self, message: EngineMessage) -> int:
        """Encodes once and broadcasts; returns the byte count."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        data = self.sender.encode(message)
        self.sender.send_bytes(data)
        self.last_encode_bytes = len(data)
        return len(data)

    async def recv(self, timeout_s: float) -> WorkerMessage:
        """The next message from any worker; EngineDeadError on failure, death or timeout."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            self._check_alive()
            left = deadline - time.monotonic()
            if left <= 0:
                self._die(f"no answer from the workers within {timeout_s:.0f}s (step timeout)")
            try:
                msg = await self.receiver.recv(min(LIVENESS_POLL_S, left))
            except ChannelTimeout:
                continue
            except msgspec.MsgspecError as e:
                logger.error("dropped a malformed worker message: %s", e)
                continue
            if isinstance(msg, WorkerFailure):
                self.failure = msg
                self._die(f"worker {msg.rank} failed: {msg.message}")
            return msg

    async def recv_output(self, timeout_s: float) -> ModelOutput:
        while True:
            msg = await self.recv(timeout_s)
            if isinstance(msg, ModelOutput):
                return msg

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        for rank, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                self._die(f"worker {rank} (pid {p.pid}) exited with code {code}")

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("engine dead: %s", reason)
        self.kill_workers()
        raise EngineDeadError(reason)

    # -- shutdown ---------------------------------------------------------------------------------
    def kill_workers(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error("worker pid %d did not exit after SIGKILL", p.pid)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self.dead_reason is None and any(p.poll() is None for p in self.procs):
            try:
                self.sender.send(Shutdown())
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill_workers()
        if self._death_pipe_w is not None:
            os.close(self._death_pipe_w)
            self._death_pipe_w = None
        self.sender.close()
        self.receiver.close()
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
