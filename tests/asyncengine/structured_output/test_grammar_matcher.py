"""GrammarCompiler and GrammarMatcher over the default model's real tokenizer: what each kind of
constraint accepts and rejects, masks that agree with acceptance, EOS at the end, rollback, padding."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance
import numpy as np
import pytest

from asyncengine.errors import ConfigError
from asyncengine.structured_output import (
    GrammarCompiler,
    GrammarMatcher,
    StructuredOutputError,
    StructuredOutputsParams,
    allocate_bitmask,
    allowed_token_ids,
    bitmask_words,
    fill_bitmasks,
    is_allowed,
)

P = StructuredOutputsParams
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
SQL = r"""root ::= "SELECT " ident (", " ident)* " FROM " ident ";"
ident ::= [a-z_]+
"""


def mask_of(m: GrammarMatcher) -> np.ndarray:
    out = allocate_bitmask(1, m.vocab_size)
    out[:] = 0  # the fill must write every word, not rely on the initial all-ones
    m.fill_bitmask(out)
    return out[0]


def feed(m: GrammarMatcher, tokenizer: Any, text: str) -> int:
    """Accepts text's tokens one by one, each checked against the mask first; returns how many the
    grammar took (it stops at the first it rejects: that token must have been masked out too). The
    texts are tokenized canonically, so the mask allows every token the grammar takes."""
    tokens = tokenizer.encode(text)
    for i, t in enumerate(tokens):
        allowed = is_allowed(mask_of(m), t)
        accepted = m.accept_token(t)
        assert accepted == allowed, f"token {i} {tokenizer.decode([t])!r}: mask {allowed}, accept {accepted}"
        if not accepted:
            return i
    return len(tokens)


@pytest.mark.parametrize(
    ("params", "text"),
    [
        (P(json=PERSON), '{"name": "Ada Lovelace", "age": 36}'),
        (  # pretty-printed JSON needs a whitespace pattern: the default allows one space per gap
            P(json=PERSON, whitespace_pattern=r"(\n[ ]{0,16}| )?"),
            '{\n  "name": "A \\"quoted\\" name",\n  "age": -7\n}',
        ),
        (P(json=PERSON, disable_any_whitespace=True), '{"name":"Ada","age":36}'),
        (P(json={"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1}), '["red", "green"]'),
        (P(json_object=True), '{"anything": [1, 2.5, null, {"nested": true}]}'),
        (P(regex=r"\d{3}-\d{4}"), "555-1234"),
        (P(regex=r"(cat|dog)s?"), "dogs"),
        (P(choice=["positive", "negative", "neutral"]), "negative"),
        (P(grammar=SQL), "SELECT name, age FROM users;"),
        (P(grammar='start: "x" NUMBER\nNUMBER: /[0-9]+/'), "x42"),
    ],
)
def test_accepts_matching_text(compiler: GrammarCompiler, tokenizer: Any, params: P, text: str) -> None:
    m = compiler.matcher(params)
    assert feed(m, tokenizer, text) == len(tokenizer.encode(text))
    assert m.is_accepting()
    assert not m.is_terminated()
    assert m.error is None


@pytest.mark.parametrize(
    ("params", "text", "accepted_before", "complete"),
    [
        (P(json=PERSON), '{"name": 36', '{"name":', False),  # a number where a string goes
        (P(json=PERSON), '{"age": 1}', '{"', False),  # properties in schema order: name first
        (P(json=PERSON, disable_any_whitespace=True), '{"name": "A"', '{"name":', False),  # no " "
        (P(json_object=True), "[1]", "", False),
        (P(regex=r"\d{3}-\d{4}"), "55a", "55", False),
        (P(regex=r"\d{3}-\d{4}"), "555-12345", "555-1234", True),  # complete: nothing more
        (P(choice=["positive", "negative"]), "posh", "pos", False),
        (P(grammar=SQL), "SELECT * FROM t;", "SELECT", False),
    ],
)
def test_rejects_the_first_wrong_token(
    compiler: GrammarCompiler, tokenizer: Any, params: P, text: str, accepted_before: str, complete: bool
) -> None:
    m = compiler.matcher(params)
    taken = feed(m, tokenizer, text)
    assert tokenizer.decode(tokenizer.encode(text)[:taken]) == accepted_before
    assert m.num_tokens == taken
    assert m.is_accepting() == complete
    assert m.error is None  # a rejected token leaves no error state behind


def test_forced_text_is_masked_to_its_canonical_tokens(compiler: GrammarCompiler, tokenizer: Any) -> None:
    m = compiler.matcher(P(grammar=SQL))  # "SELECT " is forced
    assert [tokenizer.decode([t]) for t in allowed_token_ids(mask_of(m), m.vocab_size)] == ["SE"]
    spelled = tokenizer.convert_tokens_to_ids(list("SELECT"))  # one byte at a time
    assert None not in spelled
    assert m.accept_tokens(spelled) == 6  # any spelling is accepted
    assert m.accept_tokens(tokenizer.encode(" a FROM b;")) == len(tokenizer.encode(" a FROM b;"))
    assert m.is_accepting()


def test_rejection_leaves_the_state_as_it_was(compiler: GrammarCompiler, tokenizer: Any) -> None:
    m = compiler.matcher(P(json=PERSON))
    assert feed(m, tokenizer, '{"name": "Ada", "age":') > 0
    assert not m.accept_token(tokenizer.encode('"')[0])
    assert not m.accept_token(10**6)  # out of the vocabulary
    assert not m.accept_token(-1)
    rest = tokenizer.encode(" 36}")
    assert m.accept_tokens(rest) == len(rest) and m.is_accepting()


@pytest.mark.parametrize(
    ("params", "prefix"),
    [
        (P(json=PERSON), '{"name": "Ad'),  # in a string: nearly everything
        (P(json=PERSON), '{"name": "Ada", "age": 3'),
        (P(regex=r"[a-z]+@[a-z]+\.(com|org)"), "bob@exa"),
        (P(grammar=SQL), "SELECT a"),
    ],
)
def test_the_mask_is_exactly_what_accept_takes(
    compiler: GrammarCompiler, tokenizer: Any, params: P, prefix: str
) -> None:
    m = compiler.matcher(params)
    assert feed(m, tokenizer, prefix) == len(tokenizer.encode(prefix))
    taken = []
    for t in range(m.vocab_size):
        if m.accept_token(t):
            taken.append(t)
            m.rollback(1)
    allowed = allowed_token_ids(mask_of(m), m.vocab_size)
    assert list(allowed) == taken
    assert 0 < len(taken) < m.vocab_size


def test_eos_only_when_the_match_is_complete(
    compiler: GrammarCompiler, tokenizer: Any, eos_ids: list[int]
) -> None:
    m = compiler.matcher(P(regex=r"\d+"))
    assert not any(is_allowed(mask_of(m), e) for e in eos_ids)  # nothing written yet
    assert not m.accept_token(eos_ids[0])
    feed(m, tokenizer, "12")
    mask = mask_of(m)
    assert all(is_allowed(mask, e) for e in eos_ids)  # complete, and more digits may follow
    assert is_allowed(mask, tokenizer.encode("3")[0])
    assert m.is_accepting() and not m.is_stopped()
    assert m.accept_token(eos_ids[-1])
    assert m.is_terminated() and m.is_stopped()
    assert not m.accept_token(tokenizer.encode("3")[0])  # nothing after a stop token
    assert list(allowed_token_ids(mask_of(m), m.vocab_size)) == eos_ids


def test_a_finished_grammar_allows_only_eos(
    compiler: GrammarCompiler, tokenizer: Any, eos_ids: list[int]
) -> None:
    m = compiler.matcher(P(choice=["positive", "negative"]))
    feed(m, tokenizer, "positive")
    assert m.is_stopped() and m.is_accepting() and not m.is_terminated()
    assert list(allowed_token_ids(mask_of(m), m.vocab_size)) == eos_ids
    assert m.accept_token(eos_ids[0]) and m.is_terminated()
    m.rollback(1)  # the stop token only: the choice stays written
    assert not m.is_terminated() and m.is_stopped() and m.num_tokens == len(tokenizer.encode("positive"))
    m.rollback(1)
    assert not m.is_stopped() and not m.is_accepting()


def test_request_stop_token_ids_act_as_eos(
    compiler: GrammarCompiler, tokenizer: Any, eos_ids: list[int]
) -> None:
    newline = tokenizer.encode("\n")[0]
    m = compiler.matcher(P(regex=r"[a-z]+"), extra_stop_token_ids=[newline, eos_ids[0]])
    assert m.stop_token_ids == (*eos_ids, newline)
    assert not is_allowed(mask_of(m), newline) and not m.accept_token(newline)
    feed(m, tokenizer, "abc")
    assert is_allowed(mask_of(m), newline)
    assert m.accept_token(newline) and m.is_terminated()


def test_padded_vocab_ids_and_special_tokens_are_never_allowed(
    padded_compiler: GrammarCompiler, tokenizer: Any, vocab_size: int
) -> None:
    m = padded_compiler.matcher(P(json=PERSON))
    assert m.vocab_size == padded_compiler.vocab_size > vocab_size
    assert m.num_words == bitmask_words(m.vocab_size)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for prefix in ("", '{"name": "A', '{"name": "Ada", "age": 1'):
        m.reset()
        feed(m, tokenizer, prefix)
        allowed = allowed_token_ids(mask_of(m), m.vocab_size)
        assert allowed.max() < vocab_size, prefix
        assert im_start not in allowed
    assert not m.accept_token(vocab_size + 3)


def test_rollback_returns_to_the_same_state(compiler: GrammarCompiler, tokenizer: Any) -> None:
    text = '{"name": "Grace", "age": 85}'
    tokens = tokenizer.encode(text)
    m = compiler.matcher(P(json=PERSON))
    masks = []
    for t in tokens:
        masks.append(mask_of(m).copy())
        assert m.accept_token(t)
    for k in (1, 3, len(tokens)):
        m.rollback(k)
        assert m.num_tokens == len(tokens) - k
        assert np.array_equal(mask_of(m), masks[len(tokens) - k])
        assert m.accept_tokens(tokens[len(tokens) - k :]) == k
        assert m.is_accepting()
    with pytest.raises(ValueError):
        m.rollback(len(tokens) + 1)
    with pytest.raises(ValueError):
        m.rollback(-1)


def test_validate_tokens_checks_a_draft_without_moving(compiler: GrammarCompiler, tokenizer: Any) -> None:
    m = compiler.matcher(P(regex=r"\d{3}-\d{4}"))
    feed(m, tokenizer, "555")
    before = mask_of(m).copy()
    good, bad = tokenizer.encode("-12"), tokenizer.encode("x")
    assert m.validate_tokens(good + bad + good) == len(good)
    assert m.num_tokens == len(tokenizer.encode("555"))
    assert np.array_equal(mask_of(m), before)
    assert m.validate_tokens([]) == 0


def test_batch_fill_matches_single_fills(compiler: GrammarCompiler, tokenizer: Any) -> None:
    cases = [
        (P(json=PERSON), '{"name": "X'),
        (P(regex=r"\d+"), "4"),
        (P(choice=["ab", "cd"]), ""),
        (P(grammar=SQL), "SELECT a"),
    ]
    matchers = []
    for params, prefix in cases:
        m = compiler.matcher(params)
        feed(m, tokenizer, prefix)
        matchers.append(m)
    expected = np.stack([mask_of(m) for m in matchers])
    rows = [(m, 2 * i + 1) for i, m in enumerate(matchers)]  # odd rows; even rows belong to no one
    for executor in (None, llguidance.LLExecutor(num_threads=2)):
        out = allocate_bitmask(2 * len(matchers), compiler.vocab_size)
        fill_bitmasks(rows, out, executor)
        assert np.array_equal(out[1::2], expected)
        assert (out[0::2] == -1).all()  # untouched
    assert matchers[0].bitmask() == expected[0].tobytes()
    assert len(matchers[0].bitmask()) == 4 * bitmask_words(compiler.vocab_size)
    with pytest.raises(ValueError):
        matchers[0].fill_bitmask(np.zeros((1, 3), dtype=np.int32))


def test_compiled_grammars_are_cached_lru(tokenizer: Any, eos_ids: list[int]) -> None:
    compiler = GrammarCompiler(tokenizer, eos_token_ids=eos_ids, cache_size=2)
    a = compiler.compile(P(regex="a+"))
    assert compiler.compile(P(regex="a+")) is a
    b = compiler.compile(P(json=PERSON))
    assert (
        compiler.compile(
            P(
                json='{"type": "object", "properties": {"name": {"type": "string"}, '
                '"age": {"type": "integer"}}, "required": ["name", "age"]}'
            )
        )
        is b
    )
    compiler.compile(P(regex="a+"))  # a is now the most recent
    compiler.compile(P(regex="c+"))  # evicts b
    info = compiler.cache_info()
    assert (info.hits, info.misses, info.size, info.max_size) == (3, 3, 2, 2)
    assert compiler.compile(P(regex="a+")) is a
    assert compiler.compile(P(json=PERSON)) is not b
    # matchers of one compiled grammar are independent
    m1, m2 = a.matcher(), a.matcher()
    assert m1.accept_tokens(tokenizer.encode("aaa")) == len(tokenizer.encode("aaa"))
    assert m2.num_tokens == 0 and not m2.is_accepting()


def test_compile_errors_name_the_field(compiler: GrammarCompiler) -> None:
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(P(regex="(unclosed"))
    assert info.value.param == "structured_outputs.regex"
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(P(json={"type": "nope"}), names={"json": "response_format.json_schema.schema"})
    assert info.value.param == "response_format.json_schema.schema"
    with pytest.raises(StructuredOutputError):
        compiler.compile(P(regex="a", choice=["a"]))  # two constraints: never served from the cache
    compiler.compile(P(regex="a"))
    with pytest.raises(StructuredOutputError):
        compiler.compile(P(regex="a", choice=["a"]))


async def test_compile_runs_off_the_event_loop_and_threads(compiler: GrammarCompiler) -> None:
    schemas = [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(8)
    ]
    compiled = await asyncio.gather(*(asyncio.to_thread(compiler.compile, P(json=s)) for s in schemas))
    assert len({c.key for c in compiled}) == 8
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda s: compiler.compile(P(json=s)), schemas))
    assert all(a is b for a, b in zip(compiled, again))


def test_tokenizer_info_sizes_and_eos(tokenizer: Any) -> None:
    assert GrammarCompiler(tokenizer).eos_token_ids == (tokenizer.eos_token_id,)  # default: the tokenizer's
    assert GrammarCompiler(tokenizer, vocab_size=4000).vocab_size == len(tokenizer)  # never below it
    assert GrammarCompiler(tokenizer.backend_tokenizer, eos_token_ids=[0]).vocab_size == len(tokenizer)
    with pytest.raises(ConfigError):
        GrammarCompiler(tokenizer, eos_token_ids=[10**6])
    with pytest.raises(ConfigError):
        GrammarCompiler(object())
