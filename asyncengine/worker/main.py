"""Worker process entry point: `python -m asyncengine.worker.main --rank R --broadcast ADDR --results ADDR`.

The engine starts workers by this entry point, so no engine object is pickled into them. A worker
exits on its own when its parent goes away: the engine holds the write end of a pipe whose read end
the worker watches (`--parent-fd`), and EOF means the parent is dead, however it died.

The other way round, the engine's heartbeat pings on the broadcast connection are answered by this
process's ZeroMQ I/O thread, not by the serve loop: a long step never goes unanswered, a frozen
process (all its threads stopped) does, and the engine declares it dead (transport/channels.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import traceback

import msgspec
import zmq

from asyncengine.startup_trace import mark
from asyncengine.transport.channels import BroadcastReceiver, Endpoints, ResultSender
from asyncengine.transport.curve import load_client_keys
from asyncengine.transport.topology import env_local_rank, env_rank
from asyncengine.transport.wire import (
    CacheReady,
    ExecuteModelRequest,
    InitCache,
    InitWorker,
    Shutdown,
    WorkerFailure,
    WorkerReady,
)

logger = logging.getLogger("asyncengine.worker")


def watch_parent(fd: int) -> None:
    """Exits the process as soon as the engine's end of the pipe closes."""

    def wait() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        os._exit(3)

    threading.Thread(target=wait, name="parent-watch", daemon=True).start()


def preimport(rank: int, with_transformers: bool = False) -> threading.Thread:
    """Imports the worker's heavy modules in the background while the engine still starts (InitWorker
    comes once it has read its tokenizer): torch and the model code, ~1.5 s of a cold start that would
    otherwise begin only once InitWorker arrives; transformers' config machinery too (~2 s more) when
    the engine says this model's config needs it (--preimport-transformers: models/loader.py reads a
    self-contained config.json without it). The main thread joins this thread before its own imports,
    so no module is ever imported by two threads at once."""

    def run() -> None:
        try:
            import asyncengine.models.registry  # noqa: F401
            import asyncengine.worker.worker  # noqa: F401

            if with_transformers:
                import transformers.configuration_utils  # noqa: F401
                import transformers.modeling_rope_utils  # noqa: F401
        except Exception:  # the real import reports any problem, with its traceback
            pass
        mark(f"worker{rank}", "imported")

    thread = threading.Thread(target=run, name="preimport", daemon=True)
    thread.start()
    return thread


def serve(
    rank: int,
    endpoints: Endpoints,
    local_rank: int | None = None,
    preimport_transformers: bool = False,
    device_id: int | None = None,
    num_threads: int | None = None,
) -> int:
    mark(f"worker{rank}", "started")
    imports = preimport(rank, preimport_transformers)
    first_step = True
    ctx = zmq.Context()
    rx = BroadcastReceiver(ctx, endpoints)
    tx = ResultSender(ctx, endpoints)
    worker = None
    try:
        while True:
            if not rx.poll(1000):
                lost = rx.link_lost()  # TCP only: no death pipe reaches another node
                if lost is not None:
                    logger.error("worker %d exits: %s", rank, lost)
                    return 2
                continue
            data = rx.recv_bytes()
            try:
                msg = rx.decode(data)
            except msgspec.MsgspecError as e:
                # a malformed frame is dropped, never executed; the engine's step timeout notices
                logger.error("worker %d dropped a malformed frame (%d bytes): %s", rank, len(data), e)
                continue
            if isinstance(msg, ExecuteModelRequest):
                assert worker is not None
                if first_step:
                    mark(f"worker{rank}", "first-step-received")
                out = worker.execute_model(msg)
                if out is not None:
                    tx.send(out)
                if first_step:
                    first_step = False
                    mark(f"worker{rank}", "first-step")
            elif isinstance(msg, InitWorker):
                mark(f"worker{rank}", "init-received")
                imports.join()
                from asyncengine.worker.worker import Worker

                worker = Worker(rank, msg, local_rank, device_id, num_threads)
                mark(f"worker{rank}", "model-loaded")
                tx.send(WorkerReady(rank, worker.num_kv_blocks_that_fit(), os.getpid(), worker.vocab_size))
                mark(f"worker{rank}", "kv-sized")
            elif isinstance(msg, InitCache):
                assert worker is not None
                worker.init_cache(msg.num_kv_blocks)
                tx.send(CacheReady(rank))
                mark(f"worker{rank}", "cache-ready")
            elif isinstance(msg, Shutdown):
                return 0
    except Exception as e:  # report, then die: the engine fails in-flight requests with EngineDeadError
        message = f"{type(e).__name__}: {e}"
        logger.error("worker %d failed:\n%s", rank, traceback.format_exc())
        tx.send(WorkerFailure(rank, message, error_type=type(e).__name__))
        return 1
    finally:
        if worker is not None:
            worker.close()
        rx.close()
        tx.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncengine-worker")
    # torchrun-style RANK / LOCAL_RANK stand in for the flags (transport/topology.py)
    parser.add_argument("--rank", type=int, default=env_rank())
    parser.add_argument("--local-rank", type=int, default=env_local_rank())
    parser.add_argument("--broadcast", required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("--parent-fd", type=int, default=None)
    parser.add_argument("--curve-keys", default=None, help="key file written by the head (TCP only)")
    parser.add_argument(
        "--device-id", type=int, default=None, help="the GPU to bind (default: the local rank)"
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch threads on CPU (default: the engine's setting)"
    )
    parser.add_argument(
        "--preimport-transformers",
        action="store_true",
        help="import transformers' config machinery in the background (the model's config needs it)",
    )
    args = parser.parse_args(argv)
    if args.rank is None:
        parser.error("--rank (or RANK in the environment) is required")
    logging.basicConfig(
        level=os.environ.get("ASYNCENGINE_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s worker{args.rank} %(levelname)s %(message)s",
    )
    if args.parent_fd is not None:
        watch_parent(args.parent_fd)
    curve = load_client_keys(args.curve_keys) if args.curve_keys else None
    endpoints = Endpoints(args.broadcast, args.results, curve)
    return serve(
        args.rank,
        endpoints,
        args.local_rank,
        args.preimport_transformers,
        args.device_id,
        args.num_threads,
    )


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: serve() has released everything (sockets, process group); the interpreter's own teardown
    # of torch and gloo would add seconds to every engine shutdown and do nothing we need
    os._exit(code)
