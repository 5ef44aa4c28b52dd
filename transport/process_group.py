"""torch.distributed setup: the world, one TP group per pipeline stage, and each stage's neighbours.

Rank layout: rank = pp_rank * tp_size + tp_rank, so a stage's TP ranks are consecutive.
torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) win when present.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, NamedTuple

import torch.distributed as dist


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


class ProcessGroups(NamedTuple):
    topology: Topology
    tp_group: Any  # this stage's TP group (None when tp_size == 1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_env() -> tuple[int, int, str] | None:
    """(rank, world_size, init_method) from torchrun's variables, when all are set."""
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in keys):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://"


def init_process_groups(topology: Topology, init_method: str, backend: str, timeout_s: float = 60.0) -> ProcessGroups:
    """Joins the world and builds every stage's TP group (all ranks must create all groups, in order)."""
    if topology.world_size == 1:
        return ProcessGroups(topology, None)
    dist.init_process_group(
        backend=backend, init_method=init_method, world_size=topology.world_size, rank=topology.rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    tp_group = None
    if topology.tp_size > 1:
        for pp in range(topology.pp_size):
            ranks = list(range(pp * topology.tp_size, (pp + 1) * topology.tp_size))
            group = dist.new_group(ranks, backend=backend)
            if pp == topology.pp_rank:
                tp_group = group
    return ProcessGroups(topology, tp_group)


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
