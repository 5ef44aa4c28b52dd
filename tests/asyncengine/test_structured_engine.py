"""Structured output through the engine: every sampled token is masked to the request's grammar on the
worker, the engine advances the grammar with each accepted token and finishes the request when the
output is complete, under everything the engine does (async scheduling, n > 1, a mixed batch,
preemption, speculative decoding, pipeline parallelism, large specs compiled off the event loop)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from tiny_models import hf_greedy

from asyncengine import LLM, AsyncEngine, EngineConfig, SamplingParams
from asyncengine.structured_output import StructuredOutputError, StructuredOutputsParams

pytestmark = pytest.mark.timeout(240)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/'


def check_json(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert isinstance(value["tags"], list) and set(value["tags"]) <= {"a", "b", "c"}


CASES: dict[str, tuple[StructuredOutputsParams, Any]] = {
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), check_json),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
    "grammar": (
        StructuredOutputsParams(grammar=GRAMMAR),
        lambda t: re.fullmatch(r"\([0-9](\+[0-9])*\)", t) or pytest.fail(t),
    ),
}


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:  # noqa: ANN001
    return tiny_model_factory("llama", tokenizer=True)


def config(model: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(**{"model": str(model), "dtype": "float32", "num_kv_blocks": 128, **kw})


async def texts(engine: AsyncEngine, prompt: str, params: SamplingParams) -> list[tuple[str, str]]:
    outs = [o async for o in engine.generate(prompt, params)]
    return [(c.text, c.finish_reason) for c in outs[-1].outputs]


def test_every_kind_holds_while_sampling_with_n_and_a_plain_neighbour(model: Path) -> None:
    """Sampled at temperature 1 (the random model would say anything), n = 3, next to an unconstrained
    greedy request whose tokens must stay HF's: masks reach only their own rows."""

    async def run() -> None:
        engine = await AsyncEngine.start(config(model))
        try:
            plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            neighbour = asyncio.ensure_future(_ids(engine, [5, 6, 7, 8], plain))
            for kind, (spec, check) in CASES.items():
                params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=200, structured_outputs=spec)
                for text, reason in await texts(engine, "hello", params):
                    assert reason == "stop", (kind, text, reason)  # finished by the grammar, not length
                    check(text)
            assert await neighbour == hf_greedy(model, [[5, 6, 7, 8]], 12)[0]
        finally:
            await engine.shutdown()

    asyncio.run(run())


async def _ids(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    outs = [o async for o in engine.generate(prompt, params)]
    return outs[-1].outputs[0].token_ids


def test_bad_specs_are_typed_errors_naming_the_field(model: Path) -> None:
    with pytest.raises(StructuredOutputError) as info:
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    assert info.value.param == "structured_outputs.regex"
    with pytest.raises(StructuredOutputError):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"]))
    with pytest.raises(Exception, match="structured_outputs"):
        SamplingParams.from_dict({"structured_outputs": {"json": 5}})


def test_large_specs_compile_off_the_loop_and_grammar_survives_preemption(model: Path) -> None:
    """A choice list past the inline limit is compiled in a thread; a KV cache too small for the batch
    preempts sequences mid-output, and their recompute keeps the grammar's state."""
    choices = [f"option number {i:04d} " + "x" * (i % 7) for i in range(400)]  # > 4096 chars of spec
    spec = StructuredOutputsParams(choice=choices)
    assert len(spec.cache_key()) > 4096

    async def run() -> None:
        engine = await AsyncEngine.start(
            config(model, num_kv_blocks=24, block_size=8, max_num_seqs=16, max_model_len=160)
        )
        try:
            params = SamplingParams(temperature=1.0, seed=3, max_tokens=100, structured_outputs=spec)
            regex = SamplingParams(
                temperature=1.0, seed=4, max_tokens=100, structured_outputs=CASES["regex"][0]
            )
            # compiled first, so that all twelve requests run at once and overflow the 24 blocks
            await asyncio.to_thread(engine.input_processor.compile_grammar, params)
            got = await asyncio.gather(
                *(texts(engine, "pick one " * 10, params) for _ in range(6)),
                *(texts(engine, "code " * 14, regex) for _ in range(6)),
            )
            for (text, reason), *_ in got[:6]:
                assert text in choices and reason == "stop", text
            for (text, reason), *_ in got[6:]:
                assert re.fullmatch(REGEX, text) and reason == "stop", text
            assert engine.stats.registry.get_sample_value("asyncengine:num_preemptions_total") > 0
        finally:
            await engine.shutdown()

    asyncio.run(run())


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        {"pipeline_parallel_size": 2},
        {"tensor_parallel_size": 2},
        {"num_speculative_tokens": 3},
        {"async_scheduling": False},
    ],
    ids=["pp2", "tp2", "spec3", "sync"],
)
def test_constrained_greedy_is_the_same_under_every_layout(model: Path, layout: dict[str, Any]) -> None:
    """Greedy constrained outputs equal the default engine's (async scheduling, one process) with
    pipeline parallelism (masks on the last stage), tensor parallelism (rank 0 masks the gathered logits
    and samples), speculative decoding (no drafts for constrained
    sequences, drafts for the plain one) and synchronous scheduling."""
    prompts = ["hello", "the cat", "x = 1"]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(**kw: Any) -> tuple[list[str], list[int]]:
        llm = LLM(model=str(model), dtype="float32", num_kv_blocks=128, num_threads=1, **kw)
        try:
            out = []
            for spec, _ in CASES.values():
                params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=spec)
                out += [o.outputs[0].text for o in llm.generate(prompts, params)]
            return out, llm.generate([[9, 8, 7, 6, 9, 8, 7]], plain)[0].outputs[0].token_ids
        finally:
            llm.shutdown()

    base, base_plain = run()
    got, got_plain = run(**layout)
    assert got == base
    assert got_plain == base_plain
    for (_, check), chunk in zip(CASES.values(), [base[i : i + 3] for i in range(0, len(base), 3)]):
        for text in chunk:
            check(text)


def test_a_grammar_over_the_time_limit_fails_alone(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer's compile of a large schema past the time limit: that request gets the typed error
    (naming the field), the engine serves the plain request beside it and the next constrained one."""
    from asyncengine.structured_output import limits

    props = {f"field_{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(2000)}
    wide = StructuredOutputsParams(json={"type": "object", "properties": props, "required": list(props)})
    params = SamplingParams(max_tokens=8, structured_outputs=wide)  # validated under the default limit

    async def run() -> None:
        engine = await AsyncEngine.start(config(model))
        try:
            monkeypatch.setattr(limits, "COMPILE_TIME_LIMIT_S", 0.001)
            plain = asyncio.create_task(texts(engine, "hello " * 4, SamplingParams(max_tokens=12)))
            with pytest.raises(StructuredOutputError, match="took longer") as info:
                await texts(engine, "fill it in", params)
            assert info.value.param == "structured_outputs.json"
            (text, reason), *_ = await asyncio.wait_for(plain, 60)
            assert reason == "length"
            choice = SamplingParams(max_tokens=32, structured_outputs=CASES["choice"][0])
            (text, reason), *_ = await texts(engine, "pick", choice)
            assert text in CHOICES and reason == "stop"
        finally:
            await engine.shutdown()

    asyncio.run(run())
