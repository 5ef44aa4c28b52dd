"""The Ray actor that hosts one worker: a thin shell around `python -m asyncengine.worker.main`.

The actor starts the worker as a subprocess (worker_procs.py, the same program the mp backend starts)
and holds the write end of its death pipe, so an actor that dies (killed, its node lost) takes its
worker with it; the other way round, `wait` returns the worker's exit code and the actor then exits
too, so a dead worker is never hidden behind a live actor. The worker never imports ray.

Only plain ints, strings and lists of them cross these calls: Ray pickles call arguments, and this is
start-up only; every step travels over ZeroMQ as msgspec (docs/architecture.md).
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading

import ray

from asyncengine.transport.channels import Endpoints
from asyncengine.transport.curve import write_key_text
from asyncengine.worker_procs import WorkerProcs

EXIT_AFTER_WORKER_S = 0.5  # the actor outlives its worker briefly, so `wait` can return the exit code


def cuda_index(gpu_id: str, visible: str | None) -> int:
    """The CUDA device index of Ray's GPU id `gpu_id` in a process that sees `visible` (the node's
    CUDA_VISIBLE_DEVICES, kept as the raylet had it: Ray would otherwise narrow it to the actor's GPU,
    which breaks peer access between the ranks of a node — vllm #25113, #3818). Ray's ids are entries
    of that list when it is set, physical indices when it is not."""
    if not visible:
        return int(gpu_id)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if gpu_id not in entries:
        raise ValueError(f"GPU {gpu_id} assigned by Ray is not in CUDA_VISIBLE_DEVICES={visible}")
    return entries.index(gpu_id)


@ray.remote(max_concurrency=4)  # `wait` blocks a thread while the other calls are answered
class WorkerHost:
    def __init__(self) -> None:
        self.workers = WorkerProcs()
        self._dir = tempfile.mkdtemp(prefix="asyncengine-ray-")

    def node(self) -> tuple[str, str]:
        """(node ip, Ray node id) of this actor."""
        ctx = ray.get_runtime_context()
        return ray.util.get_node_ip_address(), ctx.get_node_id()

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(
        self,
        rank: int,
        world_size: int,
        broadcast: str,
        results: str,
        key_text: str,
        flags: list[str],
        num_threads: int,
    ) -> int:
        """Starts the worker; returns its pid. key_text: the CURVE client key file's text, or "" (ipc)."""
        extra = list(flags)
        if key_text:
            extra += ["--curve-keys", str(write_key_text(key_text, os.path.join(self._dir, "keys.json")))]
        gpus = ray.get_gpu_ids()
        if gpus:
            extra += ["--device-id", str(cuda_index(str(gpus[0]), os.environ.get("CUDA_VISIBLE_DEVICES")))]
        else:
            extra += ["--num-threads", str(num_threads)]
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(num_threads)  # Ray sets it per actor; the worker sizes torch itself
        # LOCAL_RANK 0: the worker's device comes from --device-id (GPU) or is the CPU
        self.workers.start([(rank, 0)], Endpoints(broadcast, results), extra, env, world_size)
        return self.workers.procs[0].pid

    def wait(self) -> int:
        """Blocks until the worker exits; returns its exit code, then the actor exits too."""
        code = self.workers.procs[0].wait()
        threading.Timer(EXIT_AFTER_WORKER_S, os._exit, args=(0,)).start()
        return code

    def stop(self) -> None:
        """Kills the worker now (the engine is shutting down or dead)."""
        self.workers.kill()
        self.workers.close()
