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
    eng = await AsyncEngine.start(
        EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, max_model_len=512, block_size=8)
    )
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
    outs = await collect(
        engine,
        "Hello",
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], output_kind=OutputKind.DELTA
        ),
    )
    text = "".join(o.outputs[0].text for o in outs)
    assert text == full.text[: full.text.index(stop)]
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
    incl = await collect(
        engine,
        "Hello",
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
    )
    assert incl[-1].outputs[0].text == full.text[: full.text.index(stop) + len(stop)]
    tok = full.token_ids[4]
    outs = await collect(
        engine, "Hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[tok])
    )
    got = outs[-1].outputs[0]
    assert got.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]
    assert got.stop_reason == tok
    # min_tokens keeps the stop token from ending the stream too early
    outs = await collect(
        engine,
        "Hello",
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[tok], min_tokens=8),
    )
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
    outs = await collect(
        engine, "Hello", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    )
    final = outs[-1]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    greedy = await collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    penal = await collect(
        engine,
        "Hello",
        SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=1.5
        ),
    )
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
    good = asyncio.create_task(
        collect(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    )
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
    for bad in (
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(max_tokens=0),
        dict(temperature=float("nan")),
        dict(logprobs=100),
        dict(n=0),
    ):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**bad)


@pytest.mark.parametrize(
    "bad",
    [
        dict(top_k=2**70),
        dict(min_tokens=2**64, max_tokens=None),
        dict(stop_token_ids=[2**70], min_tokens=1),
        dict(seed=2**63),
        dict(max_tokens=2**64),
        dict(n=2.0),
        dict(top_k=True),
        dict(stop_token_ids=[1] * 300),
    ],
)
async def test_out_of_range_integers_are_refused_at_the_boundary(engine, bad) -> None:
    # ints past 64 bits used to pass validation and kill the engine when the step was encoded
    with pytest.raises(SamplingParamsError):
        SamplingParams(**bad)
    with pytest.raises(SamplingParamsError):
        SamplingParams.from_dict(bad)
    assert engine.is_running


async def test_strict_types_from_untrusted_dicts() -> None:
    for bad in ({"max_tokens": "4"}, {"n": 2.0}, {"temperature": True}, {"ignore_eos": 1}, {"stop": [1]}):
        with pytest.raises(SamplingParamsError):
            SamplingParams.from_dict(bad)
    ok = SamplingParams.from_dict({"temperature": 1, "stop": "x", "top_k": -1})
    assert ok.temperature == 1.0 and ok.stop == ["x"] and ok.top_k == 0


async def test_stop_token_ids_beyond_the_vocabulary_are_refused(engine) -> None:
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        await collect(engine, "Hello", SamplingParams(stop_token_ids=[engine.vocab_size], min_tokens=1))


async def test_a_step_that_does_not_encode_fails_only_its_request(engine) -> None:
    # the second line of defence behind validation: a value that slips past it (here set after
    # validation) fails its own request when the step is encoded; the engine and the rest of the batch go on
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = (await collect(engine, "def f(x):", params))[-1].outputs[0].token_ids
    good = asyncio.create_task(collect(engine, "def f(x):", params))
    bad_params = SamplingParams(max_tokens=12)
    bad = engine.generate("Hello", bad_params, "unencodable")
    bad_params.top_k = 2**70  # after validation, before the loop builds the step
    with pytest.raises(InvalidRequestError, match="cannot be sent"):
        await collect_gen(bad)
    assert (await good)[-1].outputs[0].token_ids == reference
    assert engine.is_running and "unencodable" not in engine.requests
    for _ in range(100):
        if not engine._in_flight:
            break
        await asyncio.sleep(0.05)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert (await collect(engine, "def f(x):", params))[-1].outputs[0].token_ids == reference


async def collect_gen(gen):
    return [o async for o in gen]


async def test_a_long_prompt_is_tokenized_off_the_loop(engine) -> None:
    # a prompt too long by characters is refused before any tokenizing; a long one that may fit is
    # tokenized in a thread, and the loop keeps serving meanwhile
    with pytest.raises(InvalidRequestError, match="characters"):
        engine.generate("x" * (engine.max_prompt_chars + 1), SamplingParams())
    text = "word " * 2000  # 10k chars: tokenized in a thread (over INLINE_TOKENIZE_CHARS)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        await collect(engine, text, SamplingParams(max_tokens=4))
    piece = max((engine.tokenizer.decode([t]) for t in range(engine.vocab_size)), key=len)
    short = piece * (4200 // len(piece) + 1)  # over 4k chars that fit 512 tokens
    assert len(engine.tokenizer.encode(short)) < 500
    outs = await collect(engine, short, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert outs[-1].prompt == short and outs[-1].prompt_token_ids == engine.tokenizer.encode(short)


async def test_reset_prefix_cache(engine) -> None:
    """vLLM's reset_prefix_cache: refused while a request is live, then no cached prefix is found."""
    bm = engine.scheduler.block_manager
    prompt = list(range(10, 60))  # 6 full blocks of 8
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = await collect(engine, prompt, params)
    hits = bm.prefix_hits
    assert (await collect(engine, prompt, params))[-1].outputs[0].token_ids == first[-1].outputs[0].token_ids
    assert bm.prefix_hits >= hits + 48  # the second run found the prompt's full blocks
    stream = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    await stream.__anext__()
    assert engine.reset_prefix_cache() is False  # a live request holds indexed blocks
    await stream.aclose()
    for _ in range(100):
        if not engine.requests and not engine.seq_owner:
            break
        await asyncio.sleep(0.02)
    assert engine.reset_prefix_cache() is True
    hits = bm.prefix_hits
    again = await collect(engine, prompt, params)
    assert bm.prefix_hits == hits  # nothing was found
    assert again[-1].outputs[0].token_ids == first[-1].outputs[0].token_ids
