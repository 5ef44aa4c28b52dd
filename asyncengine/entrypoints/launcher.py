"""`asyncengine serve`: bind, serve /health (503) while the engine loads, then serve; drain on a signal.

Shutdown order on SIGINT/SIGTERM: close the listening socket, refuse new requests (503), wait up to the
grace period for live requests, shut the engine down (aborting what is left, stopping the workers),
then let uvicorn close the connections. A second signal skips the wait.

A dead engine (a worker died or stopped answering) has already failed its in-flight requests with 503
and /health says 503. The launcher then either starts a fresh engine with the same config
(--restart-workers; /health stays 503 until it is ready) or exits 1 with one line on stderr, so a
supervisor (systemd, Kubernetes) restarts the whole server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass

import uvicorn

from asyncengine.config import EngineConfig
from asyncengine.device_probe import driver_gpu_count
from asyncengine.dp_engine import DataParallelEngine, start_engine
from asyncengine.engine import AsyncEngine
from asyncengine.entrypoints.guard import OriginPolicy
from asyncengine.entrypoints.http_protocol import ConnectionLimits, uvicorn_options
from asyncengine.entrypoints.log_stats import DEFAULT_INTERVAL_S, log_stats, startup_line
from asyncengine.entrypoints.logging_config import uvicorn_log_config
from asyncengine.entrypoints.server import build_app
from asyncengine.entrypoints.server_state import ServerLimits
from asyncengine.errors import AsyncEngineError, ConfigError

logger = logging.getLogger("asyncengine.serve")
UVICORN_CLOSE_TIMEOUT_S = 5.0  # after the drain, for connections to close before their tasks are cancelled
DEATH_POLL_S = 0.1  # how often the launcher looks for a dead engine or an exited worker
DEAD_FLUSH_S = 1.0  # before exiting on a dead engine: time for the failed streams' error frames to go out


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    shutdown_timeout: float = 30.0
    limits: ServerLimits = ServerLimits()
    log_level: str = "info"
    access_log: bool = False
    restart_workers: bool = False  # on engine death: start a new engine (True) or exit 1 (False)
    connections: ConnectionLimits = ConnectionLimits()  # header/body/keep-alive timeouts, connection cap
    policy: OriginPolicy = OriginPolicy.for_bind(
        "127.0.0.1"
    )  # Host and Origin checks (OriginPolicy.for_bind)
    log_stats_interval: float = DEFAULT_INTERVAL_S  # seconds between throughput lines while busy (0: none)
    tool_call_parser: str = "auto"  # how tool_choice "auto" reads calls; "auto": by the chat template


class EngineDied(Exception):
    """The served engine died and --restart-workers is off: the server exits 1."""


class _Server(uvicorn.Server):
    """uvicorn's Server without its signal handlers: the launcher owns signals and shutdown order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _device_error(config: EngineConfig, count: int) -> str | None:
    if config.device == "cuda" and count == 0:
        return "--device cuda, but no CUDA device is visible"
    local = getattr(config, "nproc_per_node", config.world_size)  # workers on this node
    if count and local > count:
        return (
            f"-tp {config.tensor_parallel_size} x -pp {config.pipeline_parallel_size} needs "
            f"{local} GPUs on this node, but {count} are visible"
        )
    return None


def check_devices(config: EngineConfig) -> None:
    """Fails fast (before binding or loading) when more GPUs are requested than are visible.

    The count comes from the CUDA driver (driver_gpu_count), so the server process imports no torch.
    Only before failing is it confirmed with torch (imported here, on that path alone): a CPU-only
    torch build sees no GPU whatever the driver shows, and then "auto" runs on the CPU."""
    if config.device == "cpu" or _device_error(config, driver_gpu_count()) is None:
        return
    import torch

    error = _device_error(config, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if error is not None:
        raise ConfigError(error)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine loads so a taken port fails in a second."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ConfigError(f"cannot resolve host {host!r}: {e}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # allows TIME_WAIT, not a live listener
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


def url_host(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(config: EngineConfig, opts: ServeOptions) -> int:
    """Runs the server until a signal; returns the exit code."""
    check_devices(config)
    sock = bind(opts.host, opts.port)
    app = build_app(
        None, opts.api_key, opts.limits, opts.served_model_name, opts.policy, opts.tool_call_parser
    )
    state = app.state.server
    uv_config = uvicorn.Config(
        app,
        loop="uvloop",
        lifespan="off",
        log_level=opts.log_level,
        log_config=uvicorn_log_config(opts.log_level),
        access_log=opts.access_log,
        timeout_graceful_shutdown=UVICORN_CLOSE_TIMEOUT_S,
        ws_max_size=2 * opts.limits.max_frame_bytes,
        **uvicorn_options(opts.connections),
    )
    server = _Server(uv_config)
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():  # a second signal: skip the drain
            force.set()
            server.force_exit = True
        else:
            logger.info("shutting down: %ss grace for live requests", opts.shutdown_timeout)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
    engine: AsyncEngine | DataParallelEngine | None = None
    stats_task: asyncio.Task | None = None
    loading = asyncio.create_task(start_engine(config), name="engine-start")
    try:
        if not await _first(loading, stop.wait()):  # a signal while loading: start() stopped its workers
            return 0
        engine = loading.result()  # raises the load error, which the caller reports
        state.attach(engine)
        logger.info("%s", startup_line(engine, state.model_name, driver_gpu_count()))
        if opts.log_stats_interval > 0:
            stats_task = asyncio.create_task(
                log_stats(lambda: state.engine, opts.log_stats_interval), name="log-stats"
            )
        print(
            f"asyncengine serving {state.model_name} on http://{url_host(sock)} "
            f"(ws://{url_host(sock)}/v1/ws)",
            flush=True,
        )
        while True:
            death = asyncio.create_task(wait_dead(engine), name="engine-watch")
            if not await _first(death, stop.wait()):
                break  # a signal: drain below
            reason = death.result()
            if not opts.restart_workers:
                await state.drain(DEAD_FLUSH_S)  # the failed requests' 503s reach their clients first
                await asyncio.sleep(0.1)  # ... and the websocket writers send what their tasks queued
                raise EngineDied(f"engine died: {reason}")
            logger.error("engine died (%s): restarting the workers", reason)
            # the dead engine stays attached meanwhile: /health and new requests answer 503
            dead, engine = engine, None
            await dead.shutdown()
            loading = asyncio.create_task(start_engine(config), name="engine-restart")
            if not await _first(loading, stop.wait()):
                return 0
            engine = loading.result()
            state.attach(engine)
            logger.warning("workers restarted: serving again")
        for listener in getattr(server, "servers", []):
            listener.close()  # stop accepting; connections already open get 503 while draining
        await _first(state.drain(opts.shutdown_timeout), force.wait())
        if state.live:  # the grace period ran out, or a second signal cut it short
            logger.warning("aborting %d live requests", state.live)
        return 0
    finally:
        if stats_task is not None:
            stats_task.cancel()
        state.draining = True
        if engine is not None:
            await engine.shutdown()  # aborts what is left: streams end with finish_reason "abort"
        server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await serving
        sock.close()


async def wait_dead(engine: AsyncEngine | DataParallelEngine) -> str:
    """Returns why `engine` is dead once it is: its loop failed (a worker died or timed out mid-step), or
    a worker exited while the engine was idle (nothing else would notice until the next request)."""
    while True:
        if engine.dead is not None:
            return str(engine.dead)
        # NOTE: only when idle: with requests live, the engine's own liveness check fails them with
        # EngineDeadError (503) within half a second; shutting it down first would end them as "abort"
        if not engine.requests:
            reason = engine.idle_worker_exit()
            if reason is not None:
                return reason
        await asyncio.sleep(DEATH_POLL_S)


async def _first(main: Awaitable[object], other: Awaitable[object]) -> bool:
    """Waits for whichever finishes first; True if `main` did. The other is cancelled."""
    a, b = asyncio.ensure_future(main), asyncio.ensure_future(other)
    await asyncio.wait({a, b}, return_when=asyncio.FIRST_COMPLETED)
    won = a.done()
    for t in (a, b):
        t.cancel()  # no-op when done
    await asyncio.gather(a, b, return_exceptions=True)
    return won


def run(config: EngineConfig, opts: ServeOptions) -> int:
    try:
        return run_loop(serve(config, opts))
    except (AsyncEngineError, OSError, EngineDied) as e:
        print(f"asyncengine: error: {e}", file=sys.stderr, flush=True)
        return 1


def run_loop(coro: object) -> int:
    try:
        import uvloop
    except ImportError:  # e.g. Windows: plain asyncio
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]
