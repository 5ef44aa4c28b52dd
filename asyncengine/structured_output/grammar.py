"""A constraint (StructuredOutputsParams) as an llguidance grammar, and the check that it compiles.

llguidance takes every kind of constraint as one grammar text (JSON holding Lark rules or a JSON
schema); this module is the one place that knows how each kind maps to it. It needs no tokenizer, so
the API process can reject a bad constraint before the request reaches the engine.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from asyncengine.structured_output.spec import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# JSON whitespace by default: at most one space between tokens (compact or "a": 1, "b": 2 style).
# Unbounded whitespace (llguidance's "flexible") lets a model that likes whitespace tokens (a code model:
# newlines and indentation) emit them until max_tokens, a known failure of structured output; even a
# line break plus 16 spaces per gap let the bundled model spend its whole budget there. Pretty-printed
# JSON: pass whitespace_pattern, e.g. r"(\n[ ]{0,16})?".
DEFAULT_WHITESPACE = r"[ ]?"


def json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    """JsonCompileOptions as *defaults*: a schema's own "x-guidance" options still win (as in vLLM)."""
    options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.whitespace_pattern is not None:
        options["whitespace_pattern"] = params.whitespace_pattern
    elif not params.disable_any_whitespace:
        options["whitespace_pattern"] = DEFAULT_WHITESPACE
    return options


def regex_grammar(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of the one constraint `params` sets (validate() has checked there is one).

    Raises ValueError for what cannot even be converted (a GBNF grammar with an unknown rule, a schema
    that is not a JSON object); the rest is found by check_grammar."""
    kind = params.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(params.schema(), defaults=json_options(params))
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=json_options(params))
    if kind == "regex":
        assert params.regex is not None
        return regex_grammar(params.regex)
    if kind == "choice":
        # "start: c1 | c2 | ...", each a JSON-quoted Lark string literal: the output is exactly one choice
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    assert params.grammar is not None
    # GBNF (llama.cpp's, also xgrammar's EBNF: `root ::= ...`) is converted to Lark; Lark passes as is
    return llguidance.grammar_from("grammar", params.grammar)


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> str | None:
    """None if the grammar compiles (for `tokenizer`, or tokenizer-free), else llguidance's error.

    llguidance's parser limits (grammar size, lexer states, ...) apply here, so a hostile schema is an
    error rather than minutes of compiling."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return messages[0].strip() if is_error else None
