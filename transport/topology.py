"""The torch-free half of the process-group set-up: the rank layout, ports and torchrun-style variables.

The engine process (executor), the multi-node launcher (entrypoints/worker_cli.py) and a worker's entry
point (worker/main.py) import this module only, so none of them imports torch; transport/process_group.py
adds the torch.distributed part, which only a worker's Worker imports.

Rank layout: rank = pp_rank * tp_size + tp_rank, so a stage's TP ranks are consecutive (and, with
several nodes, node N holds ranks N * nproc .. N * nproc + nproc - 1: a stage's TP group stays on one
node when nproc is a multiple of tp_size).

torchrun-style variables win when present in a worker's environment, so a cluster launcher (torchrun,
SLURM or Kubernetes scripts) can pin them:
  MASTER_ADDR + MASTER_PORT  -> the rendezvous address (tcp://MASTER_ADDR:MASTER_PORT)
  RANK, WORLD_SIZE           -> must agree with the rank and world the worker was started for; a
                                mismatch is a RendezvousError, never a hang in a rendezvous that
                                waits for a rank nobody will bring
  LOCAL_RANK                 -> the device index on this node, when none was given
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import NamedTuple

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RendezvousError(RuntimeError):
    """The torch.distributed rendezvous is misconfigured (inconsistent torchrun variables)."""


class Topology(NamedTuple):
    rank: int
    pp_size: int
    tp_size: int

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def prev_stage_rank(self) -> int | None:
        return self.rank - self.tp_size if self.pp_rank > 0 else None

    @property
    def next_stage_rank(self) -> int | None:
        return self.rank + self.tp_size if self.pp_rank < self.pp_size - 1 else None

    @property
    def is_driver(self) -> bool:
        """The rank that reports sampled tokens: TP rank 0 of the last stage."""
        return self.pp_rank == self.pp_size - 1 and self.tp_rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on `host` (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise RendezvousError(f"{key}={raw!r} is not an integer") from None


def env_rank(env: Mapping[str, str] | None = None) -> int | None:
    """RANK from the environment (a worker started by torchrun), if set."""
    return _env_int(os.environ if env is None else env, "RANK")


def env_local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """LOCAL_RANK from the environment, if set."""
    return _env_int(os.environ if env is None else env, "LOCAL_RANK")


def env_init_method(env: Mapping[str, str] | None = None) -> str | None:
    """tcp://MASTER_ADDR:MASTER_PORT when both are set, else None."""
    env = os.environ if env is None else env
    addr, port = env.get("MASTER_ADDR"), _env_int(env, "MASTER_PORT")
    if not addr or port is None:
        return None
    host = f"[{addr}]" if ":" in addr else addr  # IPv6 literal
    return f"tcp://{host}:{port}"


def resolve_init_method(topology: Topology, init_method: str, env: Mapping[str, str] | None = None) -> str:
    """The rendezvous address this rank uses: torchrun's when set (after checking RANK / WORLD_SIZE
    agree with `topology`), else the engine's `init_method`."""
    env = os.environ if env is None else env
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    if rank is not None and rank != topology.rank:
        raise RendezvousError(
            f"RANK={rank} in the environment, but this worker was started as rank {topology.rank}"
        )
    if world is not None and world != topology.world_size:
        raise RendezvousError(
            f"WORLD_SIZE={world} in the environment, but the engine's world is "
            f"{topology.world_size} (pipeline {topology.pp_size} x tensor {topology.tp_size})"
        )
    return env_init_method(env) or init_method


def worker_env(env: Mapping[str, str], **ranks: int) -> dict[str, str]:
    """A child worker's environment: the launcher's, less the per-process torchrun variables (which
    describe the launcher, not the child), plus the given ones (e.g. RANK=3, LOCAL_RANK=1).
    MASTER_ADDR / MASTER_PORT are kept: every rank of the cluster shares them."""
    out = {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    out.update({k: str(v) for k, v in ranks.items()})
    return out
