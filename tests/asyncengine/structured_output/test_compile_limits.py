"""What compiling a constraint may cost (structured_output/limits.py): a size cap answered before any
compile, a time limit on large compiles (remembered, so a resend is refused at once), the tokenizer-free
check run once per constraint, and the compiler's cache bounded by its text."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from asyncengine.structured_output import (
    GrammarCompiler,
    StructuredOutputError,
    StructuredOutputsParams,
    limits,
    spec,
)
from asyncengine.structured_output import compiler as compiler_mod

pytestmark = pytest.mark.timeout(120)


def wide_schema(properties: int) -> dict[str, Any]:
    """An object of `properties` patterned strings; unique names, so no other test's cache has it."""
    tag = uuid.uuid4().hex[:8]
    props = {f"p{tag}_{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)}


class Calls:
    """Counts calls of a wrapped function (spec's tokenizer-free check)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.n = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.n += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> Calls:
    calls = Calls(spec.check_grammar)
    monkeypatch.setattr(spec, "check_grammar", calls)
    return calls


def test_too_large_is_refused_before_compiling(checks: Calls) -> None:
    params = StructuredOutputsParams(json=wide_schema(9000))
    assert len(params.cache_key()) > limits.MAX_GRAMMAR_CHARS
    with pytest.raises(StructuredOutputError) as info:
        params.validate({"json": "response_format.json_schema.schema"})
    assert info.value.param == "response_format.json_schema.schema"
    assert "too large" in str(info.value) and f"{limits.MAX_GRAMMAR_CHARS:,}" in str(info.value)
    assert checks.n == 0


def test_a_constraint_is_checked_once(checks: Calls) -> None:
    schema = wide_schema(3)
    StructuredOutputsParams(json=schema).validate()
    StructuredOutputsParams(json=schema).validate()  # another Struct, same constraint
    StructuredOutputsParams(json=schema, disable_any_whitespace=True).validate()  # another grammar
    assert checks.n == 2


def test_slow_compile_is_a_400_and_its_resend_is_refused_at_once(
    checks: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "COMPILE_TIME_LIMIT_S", 0.001)
    params = StructuredOutputsParams(json=wide_schema(2000))  # ~0.1 s of compiling here
    assert limits.INLINE_COMPILE_CHARS < len(params.cache_key()) <= limits.MAX_GRAMMAR_CHARS
    with pytest.raises(StructuredOutputError) as info:
        params.validate()
    assert info.value.param == "structured_outputs.json"
    assert "took longer than 0.001 s" in str(info.value)
    with pytest.raises(StructuredOutputError, match="took longer"):
        params.validate()
    assert checks.n == 1  # the resend compiled nothing
    # a small constraint compiles on the caller's thread, whatever the limit
    StructuredOutputsParams(json=wide_schema(2)).validate()


def test_large_compiles_run_in_their_own_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    names: list[str] = []

    def check(grammar: str, tokenizer: Any = None) -> None:
        names.append(threading.current_thread().name)

    monkeypatch.setattr(spec, "check_grammar", check)
    StructuredOutputsParams(json=wide_schema(200)).validate()
    StructuredOutputsParams(json=wide_schema(2)).validate()
    assert names[0].startswith("grammar-compile") and names[1] == threading.current_thread().name


def test_tokenizer_compile_has_the_time_limit_too(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = StructuredOutputsParams(json=wide_schema(2000))
    params.validate()  # passes (the API checks first); the tokenizer's compile is then too slow
    monkeypatch.setattr(limits, "COMPILE_TIME_LIMIT_S", 0.001)
    with pytest.raises(StructuredOutputError, match="took longer"):
        compiler.compile(params, {"json": "guided_json"})
    started = time.perf_counter()
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(params, {"json": "guided_json"})
    assert info.value.param == "guided_json"
    assert time.perf_counter() - started < 0.05  # refused from memory, not compiled again
    ok = StructuredOutputsParams(regex="[a-z]+")
    assert compiler.compile(ok).kind == "regex"


def test_cache_is_bounded_by_its_text(
    tokenizer: Any, vocab_size: int, eos_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)
    monkeypatch.setattr(compiler_mod, "MAX_CACHE_CHARS", 200_000)
    for _ in range(6):
        compiler.compile(StructuredOutputsParams(json=wide_schema(300)))  # ~20 KB key, ~40 KB grammar
    assert 1 <= compiler.cache_info().size < 6
    assert compiler._cache_chars == sum(len(k) + len(c.grammar) for k, c in compiler._cache.items())
    assert compiler._cache_chars <= 200_000
