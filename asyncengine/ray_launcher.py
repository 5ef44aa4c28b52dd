"""The "ray" backend of the executor: ranks placed by a Ray placement group, one actor hosting each.

Placement: one placement group per pipeline stage, one bundle per rank ({"GPU": 1} on GPUs, {"CPU": n}
on CPUs), STRICT_PACK, so the ranks of a tensor-parallel group share a node (their all-reduces are the
hot path); the stages may spread over nodes. Stages on the engine's node get the lowest ranks, so rank 0
(the rendezvous) and the first stages sit next to the engine. A group that cannot be placed within
`ray_placement_timeout` is a ConfigError naming what is missing, never an endless wait.

Transport: when every bundle landed on the engine's node the sockets are ipc, as with mp; otherwise TCP on
the engine node's address with CURVE (fresh keys; the client keys reach the actors as a string argument,
through Ray, which the cluster's token authentication protects).

Liveness: every actor's `wait()` call is outstanding from the start; it completes when the worker exits
(its exit code) or fails when the actor dies (RayActorError, also on node loss). `dead()` polls them
without blocking. The ZeroMQ heartbeat still watches every worker, as with mp.

Ray instance: `ray_address`, else RAY_ADDRESS, else a local instance that this launcher starts and
stops at `close()`. A caller that already called `ray.init` keeps its Ray.
"""

from __future__ import annotations

import logging
import os
import time

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.ray_worker_host import WorkerHost
from asyncengine.transport.channels import Endpoints
from asyncengine.worker_launcher import Placement, worker_flags

logger = logging.getLogger(__name__)

ACTOR_READY_TIMEOUT_S = 60.0
# the workers do not see Ray's own rewrite of CUDA_VISIBLE_DEVICES: they bind by device id
NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def _uses_gpus(config: EngineConfig) -> bool:
    if config.device == "cuda":
        return True
    return config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0


def ensure_ray(config: EngineConfig) -> bool:
    """Connects this process to Ray (ray_address, RAY_ADDRESS, else a local instance sized for
    data_parallel_size replicas); True if this call did, so the caller releases it with release_ray."""
    if ray.is_initialized():
        return False
    address = config.ray_address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        per_rank = max(1, config.num_threads or 1)
        ranks = config.world_size * config.data_parallel_size
        ray.init(
            num_cpus=max(os.cpu_count() or 1, ranks * per_rank), include_dashboard=False, log_to_driver=False
        )
    else:
        ray.init(address=address, log_to_driver=False)
    logger.info("ray: %s, resources %s", address or "local instance", ray.cluster_resources())
    return True


def release_ray() -> None:
    """Disconnects (and stops a local instance this process started)."""
    if ray.is_initialized():
        ray.shutdown()


class RayLauncher:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.connected_ray = False  # our ray.init (a cluster, or our own instance): close() releases it
        self.groups: list[PlacementGroup] = []
        self.hosts: list = []  # WorkerHost actor handles, by rank
        self.waits: list = []  # each host's outstanding wait() ObjectRef, by rank
        self.pids: list[int] = []
        self.local_ranks: list[int] = []  # ranks on the engine's node, whose pids this process can see
        self.rank0_ip: str | None = None
        self.cpus_per_rank = max(1, config.num_threads or 1)

    # -- placement --------------------------------------------------------------------------------
    def _init_ray(self) -> None:
        self.connected_ray = ensure_ray(self.config)

    def place(self) -> Placement:
        self._init_ray()
        c = self.config
        bundle = {"GPU": 1.0} if _uses_gpus(c) else {"CPU": float(self.cpus_per_rank)}
        self.groups = [
            placement_group([bundle] * c.tensor_parallel_size, strategy="STRICT_PACK", name="")
            for _ in range(c.pipeline_parallel_size)
        ]
        ready, _ = ray.wait(
            [g.ready() for g in self.groups], num_returns=len(self.groups), timeout=c.ray_placement_timeout
        )
        if len(ready) < len(self.groups):
            self._remove_groups()
            raise ConfigError(self._unplaceable(bundle))
        here = ray.get_runtime_context().get_node_id()
        # a stage's node: all its bundles share it (STRICT_PACK)
        nodes = [ray.util.placement_group_table(g)["bundles_to_node_id"][0] for g in self.groups]
        order = sorted(range(len(self.groups)), key=lambda s: nodes[s] != here)  # engine's node first
        self.groups = [self.groups[s] for s in order]
        nodes = [nodes[s] for s in order]
        options = {"num_gpus": 1, "num_cpus": 0} if "GPU" in bundle else {"num_cpus": self.cpus_per_rank}
        env = {NOSET_CUDA: "1"} if "GPU" in bundle else {}
        self.hosts = [
            WorkerHost.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(g, placement_group_bundle_index=i),
                runtime_env={"env_vars": env},
                max_restarts=0,
                **options,
            ).remote()
            for g in self.groups
            for i in range(c.tensor_parallel_size)
        ]
        try:
            where = ray.get([h.node.remote() for h in self.hosts], timeout=ACTOR_READY_TIMEOUT_S)
        except (RayError, TimeoutError) as e:
            self.kill()
            self.close()
            raise ConfigError(f"the Ray worker hosts did not start: {e}") from e
        self.rank0_ip = where[0][0]
        self.local_ranks = [r for r, (_, node) in enumerate(where) if node == here]
        remote = any(node != here for node in nodes)
        head_ip = ray.util.get_node_ip_address()
        logger.info(
            "ray: %d ranks placed on %d node(s)%s",
            len(self.hosts),
            len(set(nodes)),
            " (tcp)" if remote else "",
        )
        return Placement(remote, head_ip, None, None)

    def _unplaceable(self, bundle: dict[str, float]) -> str:
        c = self.config
        need = {k: v * c.world_size for k, v in bundle.items()}
        total = ray.cluster_resources()
        missing = {k: v - total.get(k, 0.0) for k, v in need.items() if total.get(k, 0.0) < v}
        what = ", ".join(f"{k}: {v:g}" for k, v in bundle.items())
        message = (
            f"Ray could not place {c.pipeline_parallel_size} stage(s) of {c.tensor_parallel_size} "
            f"bundle(s) {{{what}}} (each stage on one node) within {c.ray_placement_timeout:g}s; "
            f"the cluster has {', '.join(f'{k}: {total.get(k, 0.0):g}' for k in need)}"
        )
        if missing:
            message += f", missing {', '.join(f'{k}: {v:g}' for k, v in missing.items())}"
        else:
            message += " in all, but no node has enough for one stage, or other jobs hold it"
        return message

    # -- workers ----------------------------------------------------------------------------------
    def launch(self, endpoints: Endpoints, key_text: str | None) -> None:
        flags = worker_flags(self.config, None)  # --curve-keys is added by each host, for its own file
        calls = [
            h.start.remote(
                rank,
                self.config.world_size,
                endpoints.broadcast,
                endpoints.results,
                key_text or "",
                flags,
                self.cpus_per_rank,
            )
            for rank, h in enumerate(self.hosts)
        ]
        self.pids = ray.get(calls, timeout=ACTOR_READY_TIMEOUT_S)
        self.waits = [h.wait.remote() for h in self.hosts]

    def rendezvous_host(self) -> str | None:
        return self.rank0_ip

    def free_port_on_rank0(self) -> int | None:
        return ray.get(self.hosts[0].free_port.remote(), timeout=ACTOR_READY_TIMEOUT_S)

    def dead(self) -> str | None:
        if not self.waits:
            return None
        done, _ = ray.wait(self.waits, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.waits.index(done[0])
        try:
            code = ray.get(done[0], timeout=1)
        except RayError as e:
            return f"the Ray actor hosting worker {rank} died ({type(e).__name__}: {str(e).splitlines()[0]})"
        return f"worker {rank} (pid {self.pids[rank]}) exited with code {code}"

    def wait_exit(self, timeout_s: float) -> None:
        if self.waits:
            ray.wait(self.waits, num_returns=len(self.waits), timeout=timeout_s)

    def kill(self) -> None:
        """Kills every actor (each worker sees its death pipe close and exits) and frees the placement."""
        for h in self.hosts:
            try:
                ray.kill(h, no_restart=True)
            except RayError:
                pass
        self._wait_workers_gone(5.0)
        self.waits = []
        self._remove_groups()

    def _wait_workers_gone(self, timeout_s: float) -> None:
        """Workers on this node: wait until their pids are gone (they exit on their death pipe's EOF)."""
        deadline = time.monotonic() + timeout_s
        for pid in [self.pids[r] for r in self.local_ranks if r < len(self.pids)]:
            while time.monotonic() < deadline and _pid_alive(pid):
                time.sleep(0.02)

    def _remove_groups(self) -> None:
        for g in self.groups:
            try:
                remove_placement_group(g)
            except RayError:
                pass
        self.groups = []

    def close(self) -> None:
        if self.hosts:
            self.kill()
            self.hosts = []
        self._remove_groups()
        if self.connected_ray:
            release_ray()  # stops the instance when it is ours, else only disconnects from the cluster
        self.connected_ray = False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
