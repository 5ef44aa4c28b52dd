"""The executor's boundary: who starts the worker processes and watches them.

The Executor (executor.py) owns the step path (the ZeroMQ sockets, the codec, the heartbeat) and asks a
WorkerLauncher for everything about processes: where the ranks run, starting them, whether one has died,
stopping them. Two implementations, chosen by `EngineConfig.distributed_executor_backend`:

* "mp" (`LocalLauncher`, here): subprocesses of the engine under a death pipe; with nnodes > 1, the other
  nodes' ranks are started by hand (`asyncengine worker --head ...`, entrypoints/worker_cli.py).
* "ray" (`RayLauncher`, ray_launcher.py): a placement group and one Ray actor per rank, each hosting the
  same worker program as a subprocess. Only that module imports ray.

Either way the workers are the same program and the steps travel the same way, so the engine, the
scheduler and the workers do not know which launcher runs.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from asyncengine.config import EngineConfig
from asyncengine.errors import ModelLoadError
from asyncengine.model_config import is_self_contained, read_model_config
from asyncengine.transport.channels import Endpoints
from asyncengine.worker_procs import WorkerProcs


class Placement(NamedTuple):
    """Where the ranks run, as the step path needs to know it."""

    remote: bool  # some rank runs on another node: the sockets listen on TCP with CURVE
    host: str  # the address the engine binds when remote
    port: int | None  # the broadcast port when fixed (results: port + 1); None picks free ones
    key_file: str | None  # where the engine writes the CURVE key file for the user to copy, if anywhere


class WorkerLauncher(Protocol):
    def place(self) -> Placement:
        """Decides (or reserves) where every rank runs; may block (Ray waits for its placement group)."""
        ...

    def launch(self, endpoints: Endpoints, key_text: str | None) -> None:
        """Starts the ranks this launcher starts; they connect to `endpoints` (with the client keys of
        `key_text` over TCP)."""
        ...

    def rendezvous_host(self) -> str | None:
        """The host of rank 0 for the torch.distributed rendezvous, or None for the engine's head_host."""
        ...

    def free_port_on_rank0(self) -> int | None:
        """A free port on rank 0's node for the rendezvous, or None to pick one here."""
        ...

    def dead(self) -> str | None:
        """Why a rank this launcher watches is gone (its process exited, its host died), or None."""
        ...

    def wait_exit(self, timeout_s: float) -> None:
        """Waits up to timeout_s for the ranks to exit on their own (after a Shutdown message)."""
        ...

    def kill(self) -> None:
        """Kills every rank it started, at once; idempotent."""
        ...

    def close(self) -> None:
        """Releases what is left (death pipe, actors, placement group, a Ray instance it started)."""
        ...

    @property
    def pids(self) -> list[int]:
        """The started workers' pids, by rank (on whichever node each runs)."""
        ...


def config_needs_transformers(model_dir: str) -> bool:
    """Whether workers will read this model's config through transformers (models/loader.get_model_config)."""
    try:
        return not is_self_contained(read_model_config(model_dir))
    except ModelLoadError:
        return False  # the workers report it


def worker_flags(config: EngineConfig, key_file: str | None) -> list[str]:
    """Flags every worker of this engine gets, whoever starts it."""
    extra = ["--curve-keys", key_file] if key_file is not None else []
    if config_needs_transformers(config.model):
        extra.append("--preimport-transformers")
    return extra


class LocalLauncher:
    """The "mp" backend: node 0's ranks as subprocesses of the engine; other nodes start their own."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.workers = WorkerProcs()

    def place(self) -> Placement:
        c = self.config
        return Placement(c.nnodes > 1, c.head_host, c.head_port, c.key_file)

    def launch(self, endpoints: Endpoints, key_text: str | None) -> None:
        key_file = self.config.key_file if endpoints.curve is not None else None
        ranks = [(rank, rank) for rank in range(self.config.nproc_per_node)]
        self.workers.start(
            ranks, endpoints, worker_flags(self.config, key_file), world_size=self.config.world_size
        )

    def rendezvous_host(self) -> str | None:
        return None

    def free_port_on_rank0(self) -> int | None:
        return None

    def dead(self) -> str | None:
        exited = self.workers.exited()
        if exited is None:
            return None
        rank, pid, code = exited
        return f"worker {rank} (pid {pid}) exited with code {code}"

    def wait_exit(self, timeout_s: float) -> None:
        self.workers.wait(timeout_s)

    def kill(self) -> None:
        self.workers.kill()

    def close(self) -> None:
        self.workers.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.workers.procs]


def make_launcher(config: EngineConfig) -> WorkerLauncher:
    if config.distributed_executor_backend == "ray":
        from asyncengine.ray_launcher import RayLauncher  # the only import of ray, and only here

        return RayLauncher(config)
    return LocalLauncher(config)
