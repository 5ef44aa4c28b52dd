"""StructuredOutputsParams: exactly one constraint, checked completely, errors naming the field; the
request spellings (structured_outputs, guided_* aliases, response_format) mapped onto it."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from asyncengine.errors import InvalidRequestError
from asyncengine.structured_output import (
    StructuredOutputError,
    StructuredOutputsParams,
    structured_outputs_from_request,
)

P = StructuredOutputsParams
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "params",
    [
        P(json=SCHEMA),
        P(json='{"type": "array", "items": {"enum": ["x", "y"]}}'),
        P(json_object=True),
        P(json_object=True, disable_any_whitespace=True),
        P(json=SCHEMA, whitespace_pattern="[ ]?"),
        P(regex=r"\d{3}-[a-z]+"),
        P(choice=["yes", "no", "café", 'a "quoted" one']),
        P(grammar='root ::= "a" | "b" digit\ndigit ::= [0-9]'),  # GBNF
        P(grammar='start: "a" | "b"'),  # Lark
    ],
)
def test_valid_constraints_pass(params: StructuredOutputsParams) -> None:
    params.validate()


def error_of(params: StructuredOutputsParams, **kwargs: Any) -> StructuredOutputError:
    with pytest.raises(StructuredOutputError) as info:
        params.validate(**kwargs)
    return info.value


@pytest.mark.parametrize(
    ("params", "param", "fragment"),
    [
        (P(), "structured_outputs", "must be set"),
        (P(json_object=False), "structured_outputs", "must be set"),
        (P(json=SCHEMA, regex="a"), "structured_outputs.regex", "exactly one"),
        (P(regex="a", json_object=True), "structured_outputs.json_object", "exactly one"),
        (P(choice=["a"], grammar='root ::= "a"'), "structured_outputs.grammar", "exactly one"),
        (P(regex="(abc"), "structured_outputs.regex", "unclosed group"),
        (P(json={"type": "foo"}), "structured_outputs.json", "foo"),
        (P(json="{not json"), "structured_outputs.json", "not valid JSON"),
        (P(json="[1, 2]"), "structured_outputs.json", "must be a JSON object"),
        (P(json={"type": "object", "properties": {"a": {"not": {}}}}), "structured_outputs.json", "not"),
        (P(json={"$ref": "#/$defs/missing"}), "structured_outputs.json", "missing"),
        (P(choice=[]), "structured_outputs.choice", "non-empty"),
        (P(choice=["a", 1]), "structured_outputs.choice", "strings"),  # type: ignore[list-item]
        (P(grammar="root ::= undefined_rule"), "structured_outputs.grammar", "undefined_rule"),
        (P(grammar="start: nowhere"), "structured_outputs.grammar", "nowhere"),
        (P(grammar="   "), "structured_outputs.grammar", "empty"),
        (P(regex="a", whitespace_pattern=" "), "structured_outputs.whitespace_pattern", "json"),
        (P(json=SCHEMA, whitespace_pattern="("), "structured_outputs.whitespace_pattern", "unclosed"),
        (P(regex=5), "structured_outputs.regex", "string"),  # type: ignore[arg-type]
    ],
)
def test_invalid_constraints_name_the_field(
    params: StructuredOutputsParams, param: str, fragment: str
) -> None:
    error = error_of(params)
    assert error.param == param
    assert fragment in str(error)
    assert str(error).startswith(param + ": ")
    assert isinstance(error, InvalidRequestError) and error.http_status == 400


def test_names_map_fields_to_what_the_client_sent() -> None:
    assert error_of(P(regex="("), names={"regex": "guided_regex"}).param == "guided_regex"


def test_crosses_processes_as_msgspec() -> None:
    params = P(json=SCHEMA, disable_any_whitespace=True)
    for encode, decode in (
        (msgspec.json.encode, msgspec.json.decode),
        (msgspec.msgpack.encode, msgspec.msgpack.decode),
    ):
        assert decode(encode(params), type=P) == params
    assert msgspec.json.encode(P(regex="a")) == b'{"regex":"a"}'  # defaults left out
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"regex": "a", "schema": {}}', type=P)  # unknown fields refused
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"choice": "a"}', type=P)


def test_cache_key_equal_for_the_same_grammar_only() -> None:
    as_text = P(json='{"type":  "object",\n "properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    assert as_text.cache_key() == P(json=SCHEMA).cache_key()
    reordered = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    assert P(json=reordered).cache_key() != P(json=SCHEMA).cache_key()  # key order is output order
    assert P(json=SCHEMA, disable_any_whitespace=True).cache_key() != P(json=SCHEMA).cache_key()
    assert P(regex="a").cache_key() != P(grammar="a").cache_key()
    assert P(choice=["a", "b"]).cache_key() != P(choice=["b", "a"]).cache_key()


# -- from the request -------------------------------------------------------------------------------------
def test_no_constraint_is_none() -> None:
    assert structured_outputs_from_request() is None
    assert structured_outputs_from_request(response_format={"type": "text"}) is None
    assert structured_outputs_from_request(guided_json=None, guided_regex=None) is None


def test_structured_outputs_object() -> None:
    assert structured_outputs_from_request({"choice": ["a", "b"]}) == P(choice=["a", "b"])
    assert structured_outputs_from_request(P(regex="x+")) == P(regex="x+")
    with pytest.raises(StructuredOutputError) as info:
        structured_outputs_from_request({"regex": 5})
    assert info.value.param == "structured_outputs.regex"
    with pytest.raises(StructuredOutputError) as info:
        structured_outputs_from_request({"regex": "a", "choice": ["a"]})
    assert info.value.param == "structured_outputs.choice"


def test_guided_aliases() -> None:
    assert structured_outputs_from_request(guided_json=SCHEMA) == P(json=SCHEMA)
    assert structured_outputs_from_request(guided_choice=["x"]) == P(choice=["x"])
    assert structured_outputs_from_request(guided_grammar='root ::= "a"') == P(grammar='root ::= "a"')
    both = structured_outputs_from_request(guided_json=SCHEMA, guided_whitespace_pattern=" ?")
    assert both == P(json=SCHEMA, whitespace_pattern=" ?")
    with pytest.raises(StructuredOutputError) as info:
        structured_outputs_from_request(guided_regex="(")
    assert info.value.param == "guided_regex"
    with pytest.raises(StructuredOutputError) as info:
        structured_outputs_from_request(guided_choice="not a list")
    assert info.value.param == "guided_choice"
    with pytest.raises(StructuredOutputError) as info:
        structured_outputs_from_request(guided_regex="a", guided_choice=["a"])
    assert info.value.param in ("guided_regex", "guided_choice")
    with pytest.raises(TypeError):
        structured_outputs_from_request(guided_nonsense=1)


def test_response_format() -> None:
    assert structured_outputs_from_request(response_format={"type": "json_object"}) == P(json_object=True)
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert structured_outputs_from_request(response_format=schema_format) == P(json=SCHEMA)
    no_schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert structured_outputs_from_request(response_format=no_schema) == P(json_object=True)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    for response_format, param in [
        (bad_schema, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "yaml"}, "response_format.type"),
    ]:
        with pytest.raises(StructuredOutputError) as info:
            structured_outputs_from_request(response_format=response_format)
        assert info.value.param == param


def test_two_spellings_at_once_are_refused() -> None:
    with pytest.raises(StructuredOutputError) as info:
        structured_outputs_from_request({"regex": "a"}, response_format={"type": "json_object"})
    assert info.value.param == "response_format"
    with pytest.raises(StructuredOutputError) as info:
        structured_outputs_from_request({"regex": "a"}, guided_json=SCHEMA)
    assert info.value.param == "guided_json"
    # a text response_format is no constraint: no conflict
    assert structured_outputs_from_request({"regex": "a"}, response_format={"type": "text"}) == P(regex="a")
