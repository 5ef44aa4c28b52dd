"""The "ray" backend on a two-node cluster simulated on this machine (`ray.cluster_utils.Cluster`): a head
node without CPUs (the engine's) and two 1-CPU nodes, one pipeline stage each, so every rank is on
another node and the steps travel over TCP with CURVE. Output equals HF's; losing a node mid-stream
fails the request within 15 s and frees the rest.

Ray rewrites 127.0.0.1 to the machine's address, so the nodes use 127.0.0.2 .. 127.0.0.4."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from test_ray_executor import live_groups, pid_alive
from tiny_models import hf_greedy

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.errors import EngineDeadError

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.ray]

NODE_LOSS_BOUND_S = 15.0


@pytest.fixture(scope="module")
def cluster() -> Any:
    c = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.2", "include_dashboard": False},
    )
    nodes = [c.add_node(num_cpus=1, node_ip_address=f"127.0.0.{i}") for i in (3, 4)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def config(model: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        dtype="float32",
        num_threads=1,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        **kw,
    )


def test_two_nodes_over_tcp_equal_hf(cluster, tiny_model_factory) -> None:  # noqa: ANN001
    model = tiny_model_factory("llama", num_hidden_layers=4)
    prompts = [[5, 9, 2, 44, 17], [3, 8, 70]]

    async def run() -> list[list[int]]:
        engine = await AsyncEngine.start(config(model, num_kv_blocks=64))
        try:
            assert engine.executor.endpoints.is_tcp and engine.executor.endpoints.curve is not None
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            outs = []
            for p in prompts:
                outs.append([o async for o in engine.generate(p, params)][-1].outputs[0].token_ids)
            return outs
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == hf_greedy(model, prompts, 6)
    assert not live_groups()


def test_data_parallel_replicas_across_nodes(cluster, tiny_model_factory) -> None:  # noqa: ANN001
    """-dp 2 on the two 1-CPU nodes: each replica's placement group lands on its own node (over TCP), both
    serve, and the outputs equal HF's."""
    from asyncengine.dp_engine import DataParallelEngine, start_engine

    model = tiny_model_factory("llama", num_hidden_layers=4)
    prompts = [[5, 9, 2, 44, 17], [3, 8, 70], [11, 12, 13], [40, 41]]

    async def run() -> list[list[int]]:
        engine = await start_engine(
            EngineConfig(
                model=str(model),
                dtype="float32",
                num_threads=1,
                num_kv_blocks=64,
                data_parallel_size=2,
                distributed_executor_backend="ray",
            )
        )
        assert isinstance(engine, DataParallelEngine)
        try:
            nodes = {
                ray.util.placement_group_table(r.executor.launcher.groups[0])["bundles_to_node_id"][0]
                for r in engine.replicas
            }
            assert len(nodes) == 2  # one replica per node
            assert all(r.executor.endpoints.is_tcp for r in engine.replicas)
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

            async def one(p: list[int]) -> list[int]:
                return [o async for o in engine.generate(p, params)][-1].outputs[0].token_ids

            got = await asyncio.gather(*(one(p) for p in prompts))
            assert all(n > 0 for n in engine.routed)
            return got
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == hf_greedy(model, prompts, 6)
    assert not live_groups()


# last: it removes a node from the module's cluster
def test_losing_a_node_fails_the_stream_within_the_bound(cluster, tiny_model_factory) -> None:  # noqa: ANN001
    c, nodes = cluster
    model = tiny_model_factory("llama", num_hidden_layers=2, max_position_embeddings=4096)

    async def run() -> None:
        engine = await AsyncEngine.start(config(model, num_kv_blocks=260))
        workers = engine.executor.worker_pids
        try:
            params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
            stream = engine.generate([1, 2, 3], params, request_id="long")
            await stream.__anext__()
            rank1_node = engine.executor.launcher.groups[1]  # the stage of rank 1, placed on one node
            node_id = ray.util.placement_group_table(rank1_node)["bundles_to_node_id"][0]
            victim = next(n for n in nodes if n.node_id == node_id)
            lost_at = time.monotonic()
            await asyncio.to_thread(c.remove_node, victim, False)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            elapsed = time.monotonic() - lost_at
            print(f"node loss: EngineDeadError after {elapsed:.2f}s")
            assert elapsed < NODE_LOSS_BOUND_S, elapsed
        finally:
            await engine.shutdown()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and [p for p in workers if pid_alive(p)]:
            await asyncio.sleep(0.1)
        assert not [p for p in workers if pid_alive(p)], "a worker survived the node loss"

    asyncio.run(run())
    assert not live_groups()
