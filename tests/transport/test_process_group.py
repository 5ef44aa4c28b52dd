"""Process groups: the rank layout, and torchrun-style variables winning over the engine's address."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from asyncengine.transport.process_group import (
    RendezvousError,
    Topology,
    free_port,
    resolve_init_method,
    worker_env,
)

pytestmark = pytest.mark.timeout(90)

ENGINE_ADDR = "tcp://127.0.0.1:1"  # what the engine sent; nothing listens there


def test_topology_rank_layout() -> None:
    # P=2 x T=2: ranks 0,1 are stage 0; ranks 2,3 stage 1; the driver is stage 1's TP rank 0
    layout = [
        (t.pp_rank, t.tp_rank, t.prev_stage_rank, t.next_stage_rank, t.is_driver)
        for t in (Topology(r, 2, 2) for r in range(4))
    ]
    assert layout == [
        (0, 0, None, 2, False),
        (0, 1, None, 3, False),
        (1, 0, 0, None, True),
        (1, 1, 1, None, False),
    ]
    assert [Topology(r, 3, 1).prev_stage_rank for r in range(3)] == [None, 0, 1]


def test_torchrun_variables_win_and_are_checked() -> None:
    topo = Topology(1, 2, 1)
    assert resolve_init_method(topo, ENGINE_ADDR, {}) == ENGINE_ADDR
    env = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    assert resolve_init_method(topo, ENGINE_ADDR, env) == "tcp://10.1.2.3:29500"
    assert (
        resolve_init_method(topo, ENGINE_ADDR, {"MASTER_ADDR": "::1", "MASTER_PORT": "7"}) == "tcp://[::1]:7"
    )
    assert resolve_init_method(topo, ENGINE_ADDR, {"MASTER_ADDR": "h"}) == ENGINE_ADDR  # needs both
    with pytest.raises(RendezvousError, match="RANK=0"):
        resolve_init_method(topo, ENGINE_ADDR, {"RANK": "0"})
    with pytest.raises(RendezvousError, match="WORLD_SIZE=4"):
        resolve_init_method(topo, ENGINE_ADDR, {"WORLD_SIZE": "4"})
    with pytest.raises(RendezvousError, match="not an integer"):
        resolve_init_method(topo, ENGINE_ADDR, {"MASTER_ADDR": "h", "MASTER_PORT": "http"})


def test_worker_env_drops_the_launchers_ranks_keeps_the_address() -> None:
    parent = {
        "PATH": "/bin",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    assert worker_env(parent, RANK=3, LOCAL_RANK=1) == {
        "PATH": "/bin",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
        "RANK": "3",
        "LOCAL_RANK": "1",
    }


CHILD = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from asyncengine.transport.process_group import Topology, destroy_process_groups, init_process_groups
    topo = Topology(int(os.environ["RANK"]), 2, 1)
    init_process_groups(topo, "{engine_addr}", "gloo", timeout_s=30)
    t = torch.tensor([float(topo.rank + 1)])
    dist.all_reduce(t)
    print("sum", int(t.item()), flush=True)
    destroy_process_groups()
    os._exit(0)  # as the engine's workers do: no interpreter teardown of gloo's threads (it aborted once)
""")


@pytest.mark.slow
def test_two_ranks_rendezvous_through_master_addr_port() -> None:
    """RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (as torchrun does): the ranks meet there and
    never try the (dead) address the engine sent."""
    port = free_port()
    code = CHILD.format(engine_addr=ENGINE_ADDR)
    procs = []
    try:
        for rank in range(2):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert "sum 3" in out
