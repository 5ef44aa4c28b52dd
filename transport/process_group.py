"""torch.distributed setup: the world, one TP group per pipeline stage, and each stage's neighbours.

Only a worker's Worker imports this module (it imports torch). The rank layout, ports and the
torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT, which win over the engine's
address) live in transport/topology.py, which imports no torch: the engine process and the launchers
use that one. Its names are re-exported here.

The rendezvous address comes from the engine (InitWorker.dist_init_method: a free loopback port, or
the head's address with several nodes), unless MASTER_ADDR / MASTER_PORT are set in the worker's
environment (topology.resolve_init_method). Backends: NCCL between GPUs, gloo on CPU (the caller
passes `dist_backend(device)`).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import urllib.parse
from typing import Any, NamedTuple

import torch.distributed as dist

# the torch-free half (transport/topology.py), re-exported: callers that hold torch anyway import it here
from asyncengine.transport.topology import (  # noqa: F401
    TORCHRUN_VARS,
    RendezvousError,
    Topology,
    env_init_method,
    env_local_rank,
    env_rank,
    free_port,
    resolve_init_method,
    worker_env,
)


class ProcessGroups(NamedTuple):
    topology: Topology
    tp_group: Any  # this stage's TP group (None when tp_size == 1)


def init_process_groups(
    topology: Topology, init_method: str, backend: str, timeout_s: float = 60.0
) -> ProcessGroups:
    """Joins the world and builds every stage's TP group (all ranks must create all groups, in order)."""
    init_method = resolve_init_method(topology, init_method)  # checks torchrun's variables even for one rank
    if topology.world_size == 1:
        return ProcessGroups(topology, None)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = loopback_store(topology, init_method, timeout)
    dist.init_process_group(
        backend=backend,
        init_method=None if store is not None else init_method,
        store=store,
        world_size=topology.world_size,
        rank=topology.rank,
        timeout=timeout,
    )
    tp_group = None
    if topology.tp_size > 1:
        for pp in range(topology.pp_size):
            ranks = list(range(pp * topology.tp_size, (pp + 1) * topology.tp_size))
            group = dist.new_group(ranks, backend=backend)
            if pp == topology.pp_rank:
                tp_group = group
    return ProcessGroups(topology, tp_group)


def loopback_store(topology: Topology, init_method: str, timeout: datetime.timedelta) -> dist.TCPStore | None:
    """The rendezvous store when `init_method` is a loopback address (one node), else None.

    torch's own TCPStore listens on every interface ("::") whatever host the URL names; rank 0 binds
    the listening socket to the loopback address itself and hands it over, so nothing is reachable
    from the network.
    """
    url = urllib.parse.urlparse(init_method)
    try:
        loopback = (
            url.scheme == "tcp"
            and url.port is not None
            and ipaddress.ip_address(url.hostname or "").is_loopback
        )
    except ValueError:  # a host name, not an address
        loopback = False
    if not loopback:
        return None
    host, port = url.hostname or "", url.port or 0
    fd = None
    if topology.rank == 0:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            fd = sock.detach()  # the store owns the socket from here
    return dist.TCPStore(
        host, port, topology.world_size, topology.rank == 0, timeout=timeout, master_listen_fd=fd
    )


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
