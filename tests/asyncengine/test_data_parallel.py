"""Data-parallel replicas (mp): both receive work and the outputs equal HF's (a single engine's);
repeated prefixes stay on one replica; a replica whose worker dies fails only its own requests, a
request that had streamed nothing is retried on the other, /health says "degraded" and /metrics labels
every sample with its replica."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from tiny_models import hf_greedy

from asyncengine import EngineConfig, SamplingParams
from asyncengine.dp_engine import DataParallelEngine, start_engine
from asyncengine.entrypoints.server_state import ServerState
from asyncengine.errors import EngineDeadError
from asyncengine.stats import exposition

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def config(model: Path, **kw: Any) -> EngineConfig:
    base = {"model": str(model), "dtype": "float32", "num_kv_blocks": 300, "num_threads": 1}
    return EngineConfig(**{**base, "data_parallel_size": 2, **kw})


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:  # noqa: ANN001
    return tiny_model_factory("llama", num_hidden_layers=2, max_position_embeddings=4096)


async def final(engine: DataParallelEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    outs = [o async for o in engine.generate(prompt, params)]
    return outs[-1].outputs[0].token_ids


def test_both_replicas_serve_and_match_hf(model: Path) -> None:
    prompts = [[5 + i, 9, 2, 44 + i, 17, i + 1] for i in range(8)]

    async def run() -> tuple[list[list[int]], list[int]]:
        engine = await start_engine(config(model))
        assert isinstance(engine, DataParallelEngine)
        try:
            got = await asyncio.gather(*(final(engine, p) for p in prompts))
            metrics = exposition(engine.stats.registry, "m").decode()
            for i in (0, 1):
                assert f'replica="{i}"' in metrics
            assert metrics.count("# TYPE asyncengine:generation_tokens_total counter") == 1  # one family
            return got, list(engine.routed)
        finally:
            await engine.shutdown()

    got, routed = asyncio.run(run())
    assert got == hf_greedy(model, prompts, 6)
    assert all(n > 0 for n in routed), routed  # the least-loaded rule spread the burst


def test_repeated_prefixes_go_to_the_same_replica(model: Path) -> None:
    size = config(model).block_size
    shared = [(7 * j) % 400 + 3 for j in range(2 * size + 8)]  # 2 full blocks, then a partial one

    async def run() -> None:
        engine = await start_engine(config(model))
        try:
            first = await final(engine, [*shared, 1])
            assert first
            home = engine.routed.index(1)
            other_load = [
                final(engine, [(11 * j + k) % 400 + 3 for j in range(len(shared))]) for k in range(3)
            ]  # unrelated prompts keep the other replica busy enough to be "least loaded" or not
            await asyncio.gather(*other_load)
            before = list(engine.routed)
            await asyncio.gather(*(final(engine, [*shared, 100 + k]) for k in range(4)))
            gained = [a - b for a, b in zip(engine.routed, before)]
            assert gained[home] == 4 and gained[1 - home] == 0, (home, gained)
            # its prefix cache served the shared blocks
            assert engine.replicas[home].scheduler.block_manager.prefix_hits >= 4 * 2 * size
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_a_dead_replica_fails_only_its_requests(model: Path) -> None:
    async def run() -> None:
        engine = await start_engine(config(model))
        state = ServerState(engine, None, _limits(), "m")
        try:
            long = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
            streams = [engine.generate([1, 2, 3 + i], long, request_id=f"long{i}") for i in range(2)]
            firsts = [await s.__anext__() for s in streams]
            assert all(f.outputs[0].token_ids for f in firsts)
            victim = engine.owner["long0"]
            survivor_stream = streams[1] if engine.owner["long1"] != victim else None
            worker = engine.replicas[victim].executor.worker_pids[0]
            os.kill(worker, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in streams[0]:
                    pass
            deadline = time.monotonic() + 10
            while engine.replicas[victim].dead is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.dead is None and engine.degraded == [victim] and engine.is_running
            assert state.health() == "degraded"
            if survivor_stream is not None:  # the other replica's request goes on
                out = await survivor_stream.__anext__()
                assert not out.finished
                await survivor_stream.aclose()
            # new requests all land on the live replica and finish
            got = await asyncio.gather(*(final(engine, [4, 5, 6 + k]) for k in range(3)))
            assert all(len(g) == 6 for g in got)
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_unstreamed_request_is_retried_on_a_live_replica(model: Path) -> None:
    """A replica dies with a request queued that has produced nothing yet: it runs on the other one."""

    async def run() -> None:
        engine = await start_engine(config(model))
        try:
            engine.load[1] = 10**9  # route the next request to replica 0
            stream = engine.generate([8, 9, 10], GREEDY, request_id="r")
            assert engine.owner["r"] == 0
            engine.load[1] = 0
            with pytest.raises(EngineDeadError):  # before the loop sent its first step
                engine.replicas[0].executor._die("test: replica 0 killed")  # noqa: SLF001
            outs = [o async for o in stream]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
            assert engine.routed == [1, 1]
        finally:
            await engine.shutdown()

    asyncio.run(run())


def _limits() -> Any:
    from asyncengine.entrypoints.server_state import ServerLimits

    return ServerLimits()
