"""Generation under a grammar, as the engine and worker will do it: each step the engine fills the
requests' bitmask rows, the rows cross as bytes, the worker applies them to random logits (torch) and
picks greedily, the engine accepts the token. Whatever comes out must parse and satisfy the constraint.

The logits are random plus conftest's `bonus` (closing tokens up, whitespace-only tokens down), so
the walks end in tens of tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from asyncengine.layers.grammar_mask import apply_token_bitmask_
from asyncengine.structured_output import (
    GrammarCompiler,
    GrammarMatcher,
    StructuredOutputsParams,
    allocate_bitmask,
    fill_bitmasks,
)

P = StructuredOutputsParams
Generate = Callable[[GrammarCompiler, StructuredOutputsParams, int], str]  # conftest's `generate`
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "paid": {"type": "boolean"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "note": {"type": "string", "maxLength": 12},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 8}, "price": {"type": "number"}},
                "required": ["sku", "price"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "status", "paid", "items"],
    "additionalProperties": False,
}
DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
SQL = r"""root ::= "SELECT " cols " FROM " ident ("WHERE " ident " = " [0-9]+)? ";"
cols ::= "*" | ident (", " ident)*
ident ::= [a-z_]+
"""
SQL_RE = r"SELECT (\*|[a-z_]+(, [a-z_]+)*) FROM [a-z_]+(WHERE [a-z_]+ = [0-9]+)?;"
MAX_STEPS = 400  # for the batch test; generate() (conftest) has its own


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_validates(compiler: GrammarCompiler, generate: Generate, seed: int) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for params in (P(json=ORDER), P(json=ORDER, disable_any_whitespace=True)):
        text = generate(compiler, params, seed)
        value = json.loads(text)
        jsonschema.validate(value, ORDER)
        if params.disable_any_whitespace:
            assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False), text


@pytest.mark.parametrize("seed", range(6))
def test_json_object_output_is_an_object(compiler: GrammarCompiler, generate: Generate, seed: int) -> None:
    text = generate(compiler, P(json_object=True), seed)
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", range(6))
def test_regex_choice_and_grammar_outputs_match(
    compiler: GrammarCompiler, generate: Generate, seed: int
) -> None:
    assert re.fullmatch(DATE, generate(compiler, P(regex=DATE), seed))
    assert generate(compiler, P(choice=CHOICES), seed) in CHOICES
    assert re.fullmatch(SQL_RE, generate(compiler, P(grammar=SQL), seed))


def test_a_batch_with_unconstrained_rows(
    compiler: GrammarCompiler, tokenizer: Any, eos_ids: list[int], bonus: torch.Tensor
) -> None:
    """Four requests in one step, rows 0 and 2 constrained: the step's bitmask holds only their rows,
    rows 1 and 3 sample from their logits untouched."""
    gen = torch.Generator().manual_seed(7)
    matchers: dict[int, GrammarMatcher] = {
        0: compiler.matcher(P(regex=DATE)),
        2: compiler.matcher(P(json=ORDER)),
    }
    outputs: dict[int, list[int]] = {0: [], 2: []}
    for _ in range(MAX_STEPS):
        live = [row for row, m in matchers.items() if not m.is_terminated()]
        if not live:
            break
        bitmask = allocate_bitmask(len(live), compiler.vocab_size)
        fill_bitmasks([(matchers[row], i) for i, row in enumerate(live)], bitmask)
        logits = torch.randn(4, bonus.shape[0], generator=gen) + bonus
        before = logits.clone()
        apply_token_bitmask_(logits, torch.from_numpy(bitmask), live)
        for row in (1, 3):
            assert torch.equal(logits[row], before[row])
        for row in live:
            assert torch.isinf(logits[row]).any()
            token = int(logits[row].argmax())
            assert matchers[row].accept_token(token)
            if token not in eos_ids:
                outputs[row].append(token)
    assert all(m.is_terminated() for m in matchers.values())
    assert re.fullmatch(DATE, tokenizer.decode(outputs[0]))
    assert json.loads(tokenizer.decode(outputs[2]))["status"] in ("pending", "shipped", "delivered")


def test_padded_vocab_rows_never_pick_padding(
    padded_compiler: GrammarCompiler, tokenizer: Any, eos_ids: list[int], vocab_size: int
) -> None:
    """The model's logits cover the padded vocabulary; those ids must lose even with the best logits."""
    matcher = padded_compiler.matcher(P(choice=CHOICES))
    bitmask = allocate_bitmask(1, padded_compiler.vocab_size)
    out: list[int] = []
    while not matcher.is_terminated():
        matcher.fill_bitmask(bitmask)
        logits = torch.zeros(1, padded_compiler.vocab_size)
        logits[0, vocab_size:] = 100.0  # padding would win
        apply_token_bitmask_(logits, torch.from_numpy(bitmask))
        token = int(logits.argmax())
        assert token < vocab_size
        assert matcher.accept_token(token)
        out.append(token)
    assert tokenizer.decode(out[:-1]) in CHOICES and out[-1] in eos_ids
    assert np.all(bitmask[0, vocab_size // 32 :] == 0)
