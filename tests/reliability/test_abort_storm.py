"""Abort storm: 1,000 requests through the Python API, each cancelled at a random point (still waiting,
mid-prefill, mid-decode, after it finished). Afterwards every KV block is free, nothing is queued, and
new requests still give HuggingFace's greedy output."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import pytest
from reliability_helpers import chat_model
from tiny_models import hf_greedy

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.output_processor import RequestState
from asyncengine.sequence import SequenceStatus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

NUM_REQUESTS = 1000
BUDGET = 64  # max_num_batched_tokens: an 80+ token prompt takes several steps, so prefill can be cut
MAX_SEQS = 48  # fewer than the requests in flight: many wait in the queue
NUM_BLOCKS = 512
GREEDY_PROMPTS = [[5, 17, 42, 99, 7], [300, 301, 302], list(range(10, 60))]


def phase(state: RequestState) -> str:
    """Where the request is now: finished, waiting (queued or preempted), prefill, or decode."""
    if state.done:
        return "finished"
    seq = state.seqs[0]
    if seq.status == SequenceStatus.WAITING:
        return "waiting"
    return "prefill" if seq.num_computed_tokens < seq.num_prompt_tokens else "decode"


class Storm:
    def __init__(self, engine: AsyncEngine, rng: random.Random) -> None:
        self.engine = engine
        self.rng = rng
        self.phases: Counter[str] = Counter()
        self.prefill_targets: dict[str, RequestState] = {}
        self.finish_reasons: Counter[str | None] = Counter()

    async def abort(self, state: RequestState) -> None:
        where = phase(state)
        aborted = await self.engine.abort(state.request_id)
        assert aborted == (where != "finished"), (where, aborted)  # a finished id is no longer known
        self.phases[where] += 1

    async def one(self, i: int) -> None:
        plan = self.rng.choice(["waiting", "prefill", "decode", "finished", "anytime"])
        n = self.rng.randint(80, 140) if plan == "prefill" else self.rng.randint(2, 12)
        prompt = [self.rng.randrange(3, 512) for _ in range(n)]
        max_tokens = self.rng.randint(2, 16)
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=self.rng.choice([0.0, 1.0]), seed=i
        )
        rid = f"storm-{i}"
        stream = self.engine.generate(prompt, params, rid)
        state = self.engine.requests[rid]
        # decode: abort after the k-th token arrives
        abort_after = self.rng.randint(1, max_tokens - 1) if plan == "decode" else None
        consumer = asyncio.create_task(self.consume(stream, state, abort_after))
        if plan == "waiting":
            await self.abort(state)  # before the engine loop has run once: still in the queue
        elif plan == "prefill":
            self.prefill_targets[rid] = state  # after_step aborts it between two prompt chunks
        elif plan == "finished":
            await consumer
            await self.abort(state)
        elif plan == "anytime":
            await asyncio.sleep(self.rng.uniform(0, 0.1))
            await self.abort(state)
        await asyncio.wait_for(consumer, 60)  # every stream ends, aborted or not

    async def consume(self, stream, state: RequestState, abort_after: int | None) -> None:  # noqa: ANN001
        last = None
        async for out in stream:
            last = out
            if abort_after is not None and len(out.outputs[0].token_ids) >= abort_after and not out.finished:
                abort_after = None
                await self.abort(state)
        assert last is not None and last.finished
        self.finish_reasons[last.outputs[0].finish_reason] += 1

    def after_step(self) -> None:
        """Runs right after the engine processed a step's output: aborts each prefill target once part of
        its prompt is in the cache and part is not (a target whose prompt fit one chunk finishes first)."""
        for rid, state in list(self.prefill_targets.items()):
            seq = state.seqs[0]
            mid = seq.status == SequenceStatus.RUNNING and 0 < seq.num_computed_tokens < seq.num_prompt_tokens
            if mid or state.done or seq.num_output_tokens:
                del self.prefill_targets[rid]
                where = phase(state)
                assert self.engine._abort(rid) == (where != "finished")  # what abort() runs, synchronously
                self.phases[where] += 1


async def test_abort_storm_frees_every_block(tmp_path_factory: pytest.TempPathFactory) -> None:
    model: Path = chat_model(tmp_path_factory)
    # num_threads=1: on a shared, oversubscribed CPU two torch threads per worker make each step ~30x slower
    engine = await AsyncEngine.start(
        EngineConfig(
            model=str(model),
            dtype="float32",
            num_kv_blocks=NUM_BLOCKS,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=MAX_SEQS,
            num_threads=1,
        )
    )
    try:
        storm = Storm(engine, random.Random(1234))
        process = engine._process

        def process_then_abort(output: object) -> None:
            # NOTE: a hook at the step boundary, so a prompt is cut between two of its chunks for sure;
            # polling from a task instead would spin the event loop and starve the worker of CPU
            process(output)
            storm.after_step()

        engine._process = process_then_abort  # type: ignore[method-assign]
        t0 = time.monotonic()
        # in waves of 200, so the queue is long but the waits stay short
        for wave in range(0, NUM_REQUESTS, 200):
            await asyncio.wait_for(asyncio.gather(*(storm.one(i) for i in range(wave, wave + 200))), 120)
        assert not storm.prefill_targets
        engine._process = process  # type: ignore[method-assign]
        elapsed = time.monotonic() - t0
        print(
            f"abort storm: {NUM_REQUESTS} requests in {elapsed:.1f}s; aborted at {dict(storm.phases)}; "
            f"finish reasons {dict(storm.finish_reasons)}"
        )
        assert sum(storm.phases.values()) == NUM_REQUESTS
        assert sum(storm.finish_reasons.values()) == NUM_REQUESTS
        for where in ("waiting", "prefill", "decode", "finished"):
            assert storm.phases[where] >= 50, storm.phases  # every kind of cancellation really happened
        assert storm.finish_reasons["abort"] == NUM_REQUESTS - storm.phases["finished"]

        # steps still in flight return, and their aborted sequences are freed, within moments
        sched = engine.scheduler
        assert sched is not None
        bm = sched.block_manager
        deadline = time.monotonic() + 10
        while (bm.num_free_blocks != NUM_BLOCKS or sched.has_unfinished) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert bm.num_free_blocks == bm.num_blocks == NUM_BLOCKS
        assert not any(bm.ref_counts), "a block is still referenced"
        assert not sched.running and not sched.waiting and not engine.requests and not engine.seq_owner

        async def greedy(prompt: list[int]) -> list[int]:
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            return [o async for o in engine.generate(prompt, params)][-1].outputs[0].token_ids

        got = await asyncio.wait_for(asyncio.gather(*(greedy(p) for p in GREEDY_PROMPTS)), 60)
        assert got == await asyncio.to_thread(hf_greedy, model, GREEDY_PROMPTS, 12)
        assert engine.is_running
    finally:
        await engine.shutdown()
