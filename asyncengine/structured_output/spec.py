"""StructuredOutputsParams: what a request constrains its output to (vLLM's `structured_outputs`).

Exactly one of `json` (a JSON schema), `regex`, `choice` (the output is one of the strings), `grammar`
(GBNF / EBNF as llama.cpp and xgrammar write it, or Lark), or `json_object` (any JSON object: OpenAI's
response_format {"type": "json_object"}). It crosses processes with the request, so it is a msgspec
Struct; validate() checks it completely (the grammar compiles) without a tokenizer, so the API process
answers 400 before the request is queued.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from asyncengine.structured_output.errors import StructuredOutputError
from asyncengine.structured_output.grammar import check_grammar, regex_grammar, to_grammar
from asyncengine.structured_output.limits import KeySet, compile_limited

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 4096  # each becomes a Lark alternative; more is a grammar, not a choice list
# Constraints that passed validate(), by their key's digest: a request's constraint is validated by the
# API (400 before queueing), by SamplingParams.validate in the engine and before the tokenizer's compile;
# the tokenizer-free compile is the costly part (~0.25 s for a 300 KB schema) and runs once.
_validated = KeySet(4096)


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    json: str | dict[str, Any] | None = None  # a JSON schema, as an object or as its JSON text
    regex: str | None = None  # the whole output matches it (Rust regex syntax; no look-around)
    choice: list[str] | None = None
    grammar: str | None = None  # GBNF (`root ::= ...`) or Lark (`start: ...`)
    json_object: bool = False
    # JSON only (json / json_object): no whitespace between tokens (compact JSON), or this regex for it
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    @property
    def kind(self) -> Kind:
        """The one constraint set (call validate() first: with none or several, the first of KINDS set)."""
        for kind in KINDS:
            if self.is_set(kind):
                return kind
        raise StructuredOutputError(f"one of {', '.join(KINDS)} must be set", "structured_outputs")

    def is_set(self, kind: Kind) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    def schema(self) -> dict[str, Any]:
        """`json` as an object (parsed when it came as text); ValueError when it is not one."""
        schema = jsonlib.loads(self.json) if isinstance(self.json, str) else self.json
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return schema

    def cache_key(self) -> str:
        """Equal for constraints that compile to the same grammar (a schema given as text or as an
        object, differently spaced); key order is kept: it is the order the output's properties take."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json":
            value = self.schema()
        return jsonlib.dumps(
            [self.kind, value, self.disable_any_whitespace, self.whitespace_pattern],
            separators=(",", ":"),
            ensure_ascii=False,
        )

    def validate(self, names: Mapping[str, str] | None = None, *, key: str | None = None) -> None:
        """Raises StructuredOutputError unless exactly one constraint is set and it compiles.

        `names` maps a field to the request parameter it came from (e.g. {"json": "guided_json"}), so the
        error names what the client sent; by default "structured_outputs.<field>". `key`: cache_key(), where
        the caller has it already (a schema's key is a json.dumps of up to 512 KiB)."""

        def name(field: str) -> str:
            return (names or {}).get(field, f"structured_outputs.{field}")

        chosen = [k for k in KINDS if self.is_set(k)]
        if not chosen:
            raise StructuredOutputError(f"one of {', '.join(KINDS)} must be set", "structured_outputs")
        if len(chosen) > 1:
            raise StructuredOutputError(
                f"exactly one of {', '.join(KINDS)} may be set, got {' and '.join(chosen)}", name(chosen[1])
            )
        kind = chosen[0]
        self._check_types(kind, name(kind))
        if self.whitespace_pattern is not None:
            self._check_whitespace_pattern(kind, name("whitespace_pattern"))
        try:
            key = key if key is not None else self.cache_key()
        except (ValueError, TypeError) as e:  # a schema that is not an object, or not JSON (a set)
            raise StructuredOutputError(str(e), name(kind)) from e
        if key in _validated:
            return
        compile_limited(key, name(kind), lambda: self._check_grammar(name(kind)))
        _validated.add(key)

    def _check_grammar(self, param: str) -> None:
        """The tokenizer-free compile (limits.compile_limited runs it, off the caller's thread when large)."""
        try:
            grammar = to_grammar(self)
        except ValueError as e:  # not JSON, not an object, a GBNF grammar that does not convert
            raise StructuredOutputError(str(e), param) from e
        error = check_grammar(grammar)
        if error is not None:
            raise StructuredOutputError(error, param)

    def _check_whitespace_pattern(self, kind: Kind, param: str) -> None:
        if kind not in ("json", "json_object"):
            raise StructuredOutputError("only applies to json and json_object", param)
        if not isinstance(self.whitespace_pattern, str):
            raise StructuredOutputError("must be a string", param)
        error = check_grammar(regex_grammar(self.whitespace_pattern))
        if error is not None:  # blamed on the schema otherwise
            raise StructuredOutputError(error, param)

    def _check_types(self, kind: Kind, param: str) -> None:
        # msgspec checks types when the Struct is decoded; these hold for Structs built in Python too
        value = getattr(self, kind)
        if kind == "json":
            if not isinstance(value, (str, dict)):
                raise StructuredOutputError("must be a JSON schema (an object, or its JSON text)", param)
            if isinstance(value, str):
                try:
                    jsonlib.loads(value)
                except ValueError as e:
                    raise StructuredOutputError(f"is not valid JSON: {e}", param) from e
        elif kind == "choice":
            if not isinstance(value, list) or not value:
                raise StructuredOutputError("must be a non-empty list of strings", param)
            if len(value) > MAX_CHOICES:
                raise StructuredOutputError(f"at most {MAX_CHOICES} choices, got {len(value)}", param)
            if not all(isinstance(c, str) for c in value):
                raise StructuredOutputError("must be a non-empty list of strings", param)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str):
                raise StructuredOutputError("must be a string", param)
            if kind == "grammar" and not value.strip():
                raise StructuredOutputError("must not be empty", param)
