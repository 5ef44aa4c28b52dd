"""Executor: broadcasts each step's bytes once to the workers and collects their results.

Who starts the workers and watches their processes is a WorkerLauncher (worker_launcher.py): the "mp"
backend's subprocesses, described below, or the "ray" backend's actors (ray_launcher.py). The step
path, the sockets and the heartbeat are the same for both.

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
import shutil
import subprocess
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError, EngineDeadError, ModelLoadError
from asyncengine.startup_trace import mark
from asyncengine.transport.channels import (
    BroadcastSender,
    ChannelTimeout,
    CurveKeys,
    Endpoints,
    ResultReceiver,
)
from asyncengine.transport.curve import ClientAllowlist, generate_keys, key_file_text, write_key_text
from asyncengine.transport.topology import env_init_method, free_port
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
from asyncengine.worker_launcher import LocalLauncher, Placement, make_launcher

logger = logging.getLogger(__name__)

# NOTE: the XPUB reports a dropped connection only after a handshake that moves one step per socket
# poll, about two polls: a short period keeps detection near the heartbeat timeout
LIVENESS_POLL_S = 0.25
LOCAL_JOIN_TIMEOUT_S = 60.0
REMOTE_JOIN_TIMEOUT_S = 600.0  # other nodes are started by hand, after copying the key file
BIND_ATTEMPTS = 5  # free (port, port + 1) pairs tried for Ray's TCP sockets

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
        self.launcher = make_launcher(config)
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._ipc_dir: Path | None = None
        self._auth: list[ClientAllowlist] = []
        self._key_text: str | None = None
        self.sender: BroadcastSender | None = None
        self.receiver: ResultReceiver | None = None
        self.spawned = False
        self.num_kv_blocks = 0
        self.vocab_size = 0
        self.dead_reason: str | None = None
        self.last_encode_bytes = 0
        self.failure: WorkerFailure | None = None
        if isinstance(self.launcher, LocalLauncher):  # sockets now: a port in use is a ConfigError at once
            self._open(self.launcher.place())

    def _open(self, placement: Placement) -> None:
        """Binds the step sockets: ipc when every rank is on this node, TCP + CURVE otherwise."""
        try:
            if placement.remote:
                keys = generate_keys()
                self._key_text = key_file_text(keys)
                if placement.key_file is not None:  # for the user to copy to the other nodes
                    write_key_text(self._key_text, placement.key_file)
                # NOTE: the allowlists must run before the sockets bind, or the first peers skip ZAP
                self._auth = [
                    ClientAllowlist(c, [keys.client_public]) for c in (self._sync_ctx, self._async_ctx)
                ]
                self._bind_tcp(placement, keys)
            else:
                self.endpoints = Endpoints.local()
                self._ipc_dir = Path(self.endpoints.broadcast[len("ipc://") :]).parent
                self.sender = BroadcastSender(self._sync_ctx, self.endpoints, self.config.heartbeat_timeout)
                self.receiver = ResultReceiver(self._async_ctx, self.endpoints)
        except (zmq.ZMQError, OSError) as e:  # a port in use, an unwritable key file
            self._close_sockets()
            self.launcher.close()
            raise ConfigError(f"cannot set up the engine's sockets: {e}") from e

    def _bind_tcp(self, placement: Placement, keys: CurveKeys) -> None:
        """On the placement's fixed port, or on a free pair (port, port + 1), retried if one was taken."""
        for attempt in range(1 if placement.port is not None else BIND_ATTEMPTS):
            port = placement.port if placement.port is not None else free_port(placement.host)
            self.endpoints = Endpoints.tcp(placement.host, port, keys)
            try:
                self.sender = BroadcastSender(self._sync_ctx, self.endpoints, self.config.heartbeat_timeout)
                self.receiver = ResultReceiver(self._async_ctx, self.endpoints)
                return
            except zmq.ZMQError:
                if self.sender is not None:
                    self.sender.close()
                    self.sender = None
                if placement.port is not None or attempt == BIND_ATTEMPTS - 1:
                    raise

    def _close_sockets(self) -> None:
        for auth in self._auth:
            auth.stop()
        self._auth = []
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        self._sync_ctx.destroy(linger=0)
        self._async_ctx.destroy(linger=0)

    # -- start-up ---------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Starts the local worker processes (mp); the engine calls it first so workers import torch and
        load weights while the engine process loads the tokenizer. Ray's are started by `start`, off the
        event loop, once their placement group is ready."""
        if self.spawned or not isinstance(self.launcher, LocalLauncher):
            return
        mark("engine", "spawn")
        self.launcher.launch(self.endpoints, self._key_text)
        self.spawned = True

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
        if self.sender is None:  # ray: place, bind, launch, all of it off the event loop
            mark("engine", "spawn")
            self._open(await asyncio.to_thread(self.launcher.place))
            await asyncio.to_thread(self.launcher.launch, self.endpoints, self._key_text)
            self.spawned = True
        self.spawn()
        mark("engine", "init-done")  # the engine's configs and tokenizer are read
        await self._wait_for_workers()
        mark("engine", "workers-connected")
        init_method = env_init_method() or await asyncio.to_thread(self._rendezvous)
        config_json = msgspec.json.encode(self.config)
        self._sender.send(InitWorker(config_json, init_method, self.world_size))
        ready = await self._gather(WorkerReady, load_timeout_s)
        mark("engine", "workers-ready")
        self.num_kv_blocks = min(r.num_kv_blocks for r in ready)
        self.vocab_size = ready[0].vocab_size
        self._sender.send(InitCache(self.num_kv_blocks))
        await self._gather(CacheReady, load_timeout_s)
        mark("engine", "cache-ready")

    def _rendezvous(self) -> str:
        """torch.distributed's address: rank 0's node (Ray) or head_host, on a port free there."""
        host = self.launcher.rendezvous_host() or self.config.head_host
        port = self.launcher.free_port_on_rank0() or free_port(self.config.head_host)
        return f"tcp://{_host(host)}:{port}"

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The worker processes this process started itself (mp); Ray's are children of its actors."""
        return self.launcher.workers.procs if isinstance(self.launcher, LocalLauncher) else []

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the workers this engine started, by rank (mp: this node's ranks)."""
        return list(self.launcher.pids)

    @property
    def _sender(self) -> BroadcastSender:
        assert self.sender is not None, "the executor's sockets are not open"
        return self.sender

    @property
    def _receiver(self) -> ResultReceiver:
        assert self.receiver is not None, "the executor's sockets are not open"
        return self.receiver

    async def _wait_for_workers(self) -> None:
        """Waits for every rank's subscription, checking the local workers' liveness meanwhile."""
        remote = self.config.nnodes > 1  # started by hand on the other nodes
        timeout_s = REMOTE_JOIN_TIMEOUT_S if remote else LOCAL_JOIN_TIMEOUT_S
        if remote:
            logger.warning(
                "waiting for %d worker(s) of %d other node(s) on %s; copy %s to them",
                self.world_size - self.config.nproc_per_node,
                self.config.nnodes - 1,
                self.endpoints.broadcast,
                self.config.key_file,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await asyncio.to_thread(self._sender.wait_for_subscribers, self.world_size, 1.0)
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
        data = self._sender.encode(message)
        self._sender.send_bytes(data)
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
                msg = await self._receiver.recv(min(LIVENESS_POLL_S, left))
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
        reason = self.launcher.dead()
        if reason is not None:
            self._die(reason)
        # the heartbeat, and the only sign of life we get from hand-started nodes' workers
        if self.sender is not None and self.sender.poll_unsubscribed():
            self._die(
                f"a worker left the engine's heartbeat unanswered for {self.config.heartbeat_timeout:g}s "
                "or its connection dropped (its process froze or died, or its node did)"
            )

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("engine dead: %s", reason)
        if self.config.nnodes > 1:  # other nodes' idle workers exit on it; busy ones on their gloo timeout
            self._sender.send(Shutdown())
        self.kill_workers()
        raise EngineDeadError(reason)

    # -- shutdown ---------------------------------------------------------------------------------
    def kill_workers(self) -> None:
        self.launcher.kill()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self.dead_reason is None and self.spawned and self.sender is not None:
            try:
                self.sender.send(Shutdown())
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout_s
        if self.spawned:
            self.launcher.wait_exit(timeout_s)
        # other nodes' workers: keep the socket open until each has gone (so Shutdown is delivered)
        while self.config.nnodes > 1 and self.sender is not None:
            if self.sender.poll_unsubscribed() >= self.sender.subscribers or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.launcher.kill()
        self.launcher.close()
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        for auth in self._auth:
            auth.stop()
        self._sync_ctx.term()
        self._async_ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # IPv6 literal in a URL
