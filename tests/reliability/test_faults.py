"""Worker faults: a killed or frozen worker fails every in-flight request quickly, never hangs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
from tiny_models import build_tiny_model

from asyncengine import AsyncEngine, EngineConfig, EngineDeadError, SamplingParams

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("faults"), num_hidden_layers=2)


async def stream_until_dead(engine: AsyncEngine, n: int) -> list[BaseException | None]:
    async def one(i: int) -> BaseException | None:
        try:
            async for _ in engine.generate([5 + i, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)):
                pass
        except EngineDeadError as e:
            return e
        return None

    return await asyncio.gather(*(one(i) for i in range(n)))


async def wait_for_tokens(engine: AsyncEngine) -> None:
    for _ in range(600):
        if engine.stats.generation_tokens._value.get() > 20:
            return
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
async def test_dead_or_frozen_worker_fails_in_flight_requests(model, sig) -> None:
    engine = await AsyncEngine.start(
        EngineConfig(model=str(model), dtype="float32", num_kv_blocks=128, step_timeout=2.0)
    )
    pid = engine.executor.procs[0].pid
    try:
        task = asyncio.create_task(stream_until_dead(engine, 8))
        await wait_for_tokens(engine)
        t0 = time.monotonic()
        os.kill(pid, sig)
        results = await asyncio.wait_for(task, 15)
        elapsed = time.monotonic() - t0
        assert all(isinstance(r, EngineDeadError) for r in results), results
        # SIGKILL is seen by the liveness poll (< 2 s); SIGSTOP by the 2 s step timeout
        assert elapsed < (2.0 if sig == signal.SIGKILL else 5.0), elapsed
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.add_request([1, 2, 3], SamplingParams())
    finally:
        if sig == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):  # the engine already killed it
                os.kill(pid, signal.SIGCONT)
        await engine.shutdown()
    for p in engine.executor.procs:
        assert p.poll() is not None, "a worker outlived its engine"


async def test_kv_exhaustion_preempts_and_completes(model) -> None:
    engine = await AsyncEngine.start(
        EngineConfig(model=str(model), dtype="float32", num_kv_blocks=20, block_size=8, max_model_len=160)
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        prompts = [[3 + i] * (10 + 9 * i) for i in range(8)]  # up to 113 tokens: 15 of the 20 blocks

        async def run(p):
            return [o async for o in engine.generate(p, params)][-1]

        outs = await asyncio.wait_for(asyncio.gather(*(run(p) for p in prompts)), 90)
        assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
        assert engine.scheduler.num_preemptions > 0
        # the same prompts alone (no pressure) give the same tokens
        alone = [await run(p) for p in prompts[:3]]
        assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in outs[:3]]
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        await engine.shutdown()
