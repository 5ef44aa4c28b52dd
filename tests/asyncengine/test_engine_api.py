"""The AsyncEngine API: streaming, deltas, abort, seeded sampling, stop conditions and typed errors."""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio

from asyncengine import (
    AsyncEngine,
    EngineConfig,
    InvalidRequestError,
    OutputKind,
    SamplingParams,
    SamplingParamsError,
)

# one engine for the whole module: starting workers costs seconds
pytestmark = [pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_factory):
    model = tiny_model_factory("llama", tokenizer=True)
    eng = await AsyncEngine.start(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64,
                                               max_model_len=512, block_size=8))
    yield eng
    await eng.shutdown()
    assert all(p.poll() is not None for p in eng.executor.procs)


async def collect(engine, prompt, params, request_id=None):
    outs = [o async for o in engine.generate(prompt, params, request_id)]
    return outs


async def test_stream_cumulative_and_delta(engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = await collect(engine, "def fibonacci(n):", params)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    final = outs[-1].outputs[0]
    assert len(final.token_ids) == 10 and final.finish_reason == "length"
    assert final.text == engine.tokenizer.decode(final.token_ids, skip_special_tokens=True)
    for a, b in zip(outs, outs[1:]):  # cumulative: each output extends the previous one
        assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
    delta = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=OutputKind.DELTA)
    pieces = await collect(engine, "def fibonacci(n):", delta)
    assert "".join(o.outputs[0].text for o in pieces) == final.text
    assert sum((o.outputs[0].token_ids for o in pieces), []) == final.token_ids


async def test_stop_strings_and_stop_tokens(engine) -> None:
    base = await collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    full = base[-1].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    outs = await collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                          output_kind=OutputKind.DELTA))
    text = "".join(o.outputs[0].text for o in outs)
    assert text == full.text[: full.text.index(stop)]
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
    incl = await collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                          stop=[stop], include_stop_str_in_output=True))
    assert incl[-1].outputs[0].text == full.text[: full.text.index(stop) + len(stop)]
    tok = full.token_ids[4]
    outs = await collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                          stop_token_ids=[tok]))
    got = outs[-1].outputs[0]
    assert got.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]
    assert got.stop_reason == tok
    # min_tokens keeps the stop token from ending the stream too early
    outs = await collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                          stop_token_ids=[tok], min_tokens=8))
    assert len(outs[-1].outputs[0].token_ids) >= 8


async def test_seeded_sampling_reproducible_and_batch_independent(engine) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = (await collect(engine, "Hello", params))[-1].outputs[0].token_ids
    again = (await collect(engine, "Hello", params))[-1].outputs[0].token_ids
    assert alone == again
    # the same request amid a crowd of unseeded ones samples the same tokens
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    crowd = [collect(engine, f"noise {i}", noise) for i in range(6)]
    results = await asyncio.gather(collect(engine, "Hello", params), *crowd)
    assert results[0][-1].outputs[0].token_ids == alone
    other = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    assert (await collect(engine, "Hello", other))[-1].outputs[0].token_ids != alone


async def test_n_samples_and_penalties(engine) -> None:
    outs = await collect(engine, "Hello", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    final = outs[-1]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    greedy = (await collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)))
    penal = (await collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                           repetition_penalty=2.0, frequency_penalty=1.5)))
    g, p = greedy[-1].outputs[0].token_ids, penal[-1].outputs[0].token_ids
    assert len(set(p)) >= len(set(g))


async def test_abort_storm_frees_every_block(engine) -> None:
    bm = engine.scheduler.block_manager
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def one(i: int) -> None:
        prompt = [rng.randrange(3, 400) for _ in range(rng.randrange(1, 120))]
        stop_after = rng.randrange(0, 6)
        seen = 0
        async for _ in engine.generate(prompt, params, request_id=f"storm-{i}"):
            seen += 1
            if seen > stop_after:
                break  # closing the generator aborts the request

    async def abort_later(i: int) -> None:
        await asyncio.sleep(rng.random() * 0.3)
        await engine.abort(f"storm-{i}")

    tasks = [asyncio.create_task(one(i)) for i in range(200)]
    aborts = [asyncio.create_task(abort_later(i)) for i in range(0, 200, 3)]
    await asyncio.gather(*tasks, *aborts, return_exceptions=True)
    for _ in range(100):
        if not engine._in_flight and not engine.requests:
            break
        await asyncio.sleep(0.05)
    assert not engine.requests
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    # and the engine still serves correctly afterwards
    a = await collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(a[-1].outputs[0].token_ids) == 8


async def test_cancelling_the_consumer_aborts(engine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("Hello", SamplingParams(max_tokens=400, ignore_eos=True), "cancel-me"):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "cancel-me" not in engine.requests
    assert await engine.abort("cancel-me") is False


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("x" * 10, dict(max_tokens=10_000), "max_model_len"),
        ([5] * 600, dict(max_tokens=1), "max_model_len"),
        ([1, 2, 10_000], dict(), "token ids"),
        ([], dict(), "empty"),
        ("", dict(), "empty"),
    ],
)
async def test_bad_requests_are_typed_and_isolated(engine, prompt, params, match) -> None:
    good = asyncio.create_task(collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
    with pytest.raises(InvalidRequestError, match=match):
        await collect(engine, prompt, SamplingParams(**params))
    out = await good
    assert len(out[-1].outputs[0].token_ids) == 20


async def test_duplicate_request_id_and_bad_params(engine) -> None:
    gen = engine.generate("Hello", SamplingParams(max_tokens=50, ignore_eos=True), "dup")
    await gen.__anext__()
    with pytest.raises(InvalidRequestError, match="already running"):
        await collect(engine, "Hello", SamplingParams(), "dup")
    await gen.aclose()
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0),
                dict(temperature=float("nan")), dict(logprobs=100), dict(n=0)):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**bad)
