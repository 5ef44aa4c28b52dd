"""Executor: starts the worker processes, broadcasts each step's bytes once, collects results.

Workers are started by their entry point (`python -m asyncengine.worker.main`), never by pickling an
object into them. Each holds the read end of a pipe whose write end only this process has: when the
engine process dies, however it dies, the workers see EOF and exit.

Several nodes (nnodes > 1): this process is the head. It starts the ranks of node 0 itself; node N's
launcher (`asyncengine worker --head HOST:PORT --node-rank N --key-file F`) starts ranks
N * nproc .. N * nproc + nproc - 1. The sockets listen on TCP only then: the step broadcast on
head_port, the results on head_port + 1, both CURVE-encrypted, and a ZAP allowlist admits only the
client key of the key file the head writes (0600) for the user to copy. Everything else a remote
worker needs (config, torch.distributed rendezvous address) arrives in InitWorker over that channel.
A worker whose connection drops (its XPUB subscription goes away) makes the engine dead at once.

Liveness, busy or idle: a worker process that exits is seen by its exit code (local ranks), and one
that freezes (SIGSTOP, a hung host) or whose node vanishes by the broadcast socket's heartbeat: its
connection is dropped once it leaves `heartbeat_timeout` seconds of pings unanswered (the pings are
answered by ZeroMQ's I/O thread, so a long step is not a freeze). The engine checks both every
LIVENESS_POLL_S while it waits for a step's output and, through `wait_idle`, while it has none in flight.
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
from asyncengine.model_config import is_self_contained, read_model_config
from asyncengine.startup_trace import mark
from asyncengine.transport.channels import (
    BroadcastSender,
    ChannelTimeout,
    Endpoints,
    ResultReceiver,
)
from asyncengine.transport.curve import ClientAllowlist, generate_keys, write_key_file
from asyncengine.transport.topology import env_init_method, free_port, worker_env
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

# NOTE: the XPUB reports a dropped connection only after a handshake that moves one step per socket
# poll, about two polls: a short period keeps detection near the heartbeat timeout
LIVENESS_POLL_S = 0.25
LOCAL_JOIN_TIMEOUT_S = 60.0
REMOTE_JOIN_TIMEOUT_S = 600.0  # other nodes are started by hand, after copying the key file

# worker-side exception names that mean "your model or settings are wrong", not "a worker crashed"
STARTUP_ERRORS: dict[str, type[Exception]] = {
    "ModelLoadError": ModelLoadError,
    "ConfigError": ConfigError,
    "KVCacheTooSmallError": ConfigError,
    "DeviceError": ConfigError,
}


def _config_needs_transformers(model_dir: str) -> bool:
    """Whether workers will read this model's config through transformers (models/loader.get_model_config)."""
    try:
        return not is_self_contained(read_model_config(model_dir))
    except ModelLoadError:
        return False  # the workers report it


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.world_size
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._ipc_dir: Path | None = None
        self._auth: list[ClientAllowlist] = []
        try:
            if config.nnodes > 1:
                assert config.head_port is not None and config.key_file is not None  # EngineConfig checks
                keys = generate_keys()
                write_key_file(keys, config.key_file)
                self.endpoints = Endpoints.tcp(config.head_host, config.head_port, keys)
                # NOTE: the allowlists must run before the sockets bind, or the first peers skip ZAP
                self._auth = [
                    ClientAllowlist(c, [keys.client_public]) for c in (self._sync_ctx, self._async_ctx)
                ]
            else:
                self.endpoints = Endpoints.local()
                self._ipc_dir = Path(self.endpoints.broadcast[len("ipc://") :]).parent
            self.sender = BroadcastSender(self._sync_ctx, self.endpoints, config.heartbeat_timeout)
            self.receiver = ResultReceiver(self._async_ctx, self.endpoints)
        except (zmq.ZMQError, OSError) as e:  # a port in use, an unwritable key file
            for auth in self._auth:
                auth.stop()
            self._sync_ctx.destroy(linger=0)
            self._async_ctx.destroy(linger=0)
            raise ConfigError(f"cannot set up the engine's sockets: {e}") from e
        self.procs: list[subprocess.Popen] = []
        self._death_pipe_w: int | None = None
        self.num_kv_blocks = 0
        self.vocab_size = 0
        self.dead_reason: str | None = None
        self.last_encode_bytes = 0
        self.failure: WorkerFailure | None = None

    # -- start-up ---------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Starts the local worker processes; the engine calls it first so workers import torch and
        load weights while the engine process loads the tokenizer."""
        if self.procs:
            return
        mark("engine", "spawn")
        read_fd, write_fd = os.pipe()
        os.set_inheritable(read_fd, True)
        self._death_pipe_w = write_fd  # not inheritable: only this process holds it
        extra = ["--curve-keys", str(self.config.key_file)] if self.endpoints.curve is not None else []
        if _config_needs_transformers(self.config.model):
            extra.append("--preimport-transformers")
        for rank in range(self.config.nproc_per_node):  # node 0's ranks; other nodes start their own
            env = worker_env(os.environ, RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=self.world_size)
            env.setdefault("PYTHONUNBUFFERED", "1")
            cmd = [
                sys.executable,
                "-m",
                "asyncengine.worker.main",
                "--rank",
                str(rank),
                "--local-rank",
                str(rank),
                "--broadcast",
                self.endpoints.broadcast,
                "--results",
                self.endpoints.results,
                "--parent-fd",
                str(read_fd),
                *extra,
            ]
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
        self.spawn()
        mark("engine", "init-done")  # the engine's configs and tokenizer are read
        await self._wait_for_workers()
        mark("engine", "workers-connected")
        init_method = (
            env_init_method() or f"tcp://{_host(self.config.head_host)}:{free_port(self.config.head_host)}"
        )
        config_json = msgspec.json.encode(self.config)
        self.sender.send(InitWorker(config_json, init_method, self.world_size))
        ready = await self._gather(WorkerReady, load_timeout_s)
        mark("engine", "workers-ready")
        self.num_kv_blocks = min(r.num_kv_blocks for r in ready)
        self.vocab_size = ready[0].vocab_size
        self.sender.send(InitCache(self.num_kv_blocks))
        await self._gather(CacheReady, load_timeout_s)
        mark("engine", "cache-ready")

    async def _wait_for_workers(self) -> None:
        """Waits for every rank's subscription, checking the local workers' liveness meanwhile."""
        remote = self.config.nnodes > 1
        timeout_s = REMOTE_JOIN_TIMEOUT_S if remote else LOCAL_JOIN_TIMEOUT_S
        if remote:
            logger.warning(
                "waiting for %d worker(s) of %d other node(s) on %s; copy %s to them",
                self.world_size - len(self.procs),
                self.config.nnodes - 1,
                self.endpoints.broadcast,
                self.config.key_file,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await asyncio.to_thread(self.sender.wait_for_subscribers, self.world_size, 1.0)
                return
            except ChannelTimeout as e:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"workers did not connect: {e}") from None

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
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            left = deadline - time.monotonic()
            if left <= 0:
                self._die(f"no answer from the workers within {timeout_s:.0f}s (step timeout)")
            try:
                msg = await self.receiver.recv(min(LIVENESS_POLL_S, left))
            except ChannelTimeout:
                # NOTE: liveness only once nothing is pending, so a failing worker's last report (sent
                # just before it exits and unsubscribes) is read, not lost to "exited with code 1"
                self._check_alive()
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

    async def wait_idle(self, wake: asyncio.Event) -> None:
        """Waits for `wake` while no step is in flight, checking the workers' liveness meanwhile: a
        worker that dies or freezes while the engine is idle makes it dead now, not at the next step."""
        waiter = asyncio.ensure_future(wake.wait())
        try:
            while not waiter.done():
                self._check_alive()
                await asyncio.wait({waiter}, timeout=LIVENESS_POLL_S)
        finally:
            waiter.cancel()

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        for rank, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                self._die(f"worker {rank} (pid {p.pid}) exited with code {code}")
        # the heartbeat, and the only sign of life we get from another node's workers
        if self.sender.poll_unsubscribed():
            self._die(
                f"a worker left the engine's heartbeat unanswered for {self.config.heartbeat_timeout:g}s "
                "or its connection dropped (its process froze or died, or its node did)"
            )

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("engine dead: %s", reason)
        if self.config.nnodes > 1:  # other nodes' idle workers exit on it; busy ones on their gloo timeout
            self.sender.send(Shutdown())
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
        # other nodes' workers: keep the socket open until each has gone (so Shutdown is delivered)
        while self.config.nnodes > 1 and self.sender.poll_unsubscribed() < self.sender.subscribers:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.kill_workers()
        if self._death_pipe_w is not None:
            os.close(self._death_pipe_w)
            self._death_pipe_w = None
        self.sender.close()
        self.receiver.close()
        for auth in self._auth:
            auth.stop()
        self._sync_ctx.term()
        self._async_ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # IPv6 literal in a URL
