"""tool_choice "required" / named: the constraint built from the tools, the errors naming the field, and
end to end: generate under it (random logits, real tokenizer), parse with the matching parser, and the
calls name real tools with arguments valid for them."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from asyncengine.entrypoints.tool_parsers import (
    JsonArrayToolParser,
    NamedToolParser,
    required_schema,
    tool_choice_parser,
    tool_choice_structured_outputs,
)
from asyncengine.entrypoints.tool_parsers.tool_choice import tool_parameters
from asyncengine.structured_output import GrammarCompiler, StructuredOutputError, StructuredOutputsParams

Generate = Callable[[GrammarCompiler, StructuredOutputsParams, int], str]  # conftest's `generate`
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SHORT = {"$ref": "#/$defs/short"}
SEARCH = {
    "type": "object",
    "properties": {"query": SHORT, "filters": {"type": "array", "items": SHORT, "maxItems": 2}},
    "required": ["query"],
    "additionalProperties": False,
    "$defs": {"short": {"type": "string", "maxLength": 8}},
}


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [tool("get_weather", WEATHER), tool("search", SEARCH), tool("now")]


def test_none_and_auto_constrain_nothing() -> None:
    for choice in (None, "none", "auto"):
        assert tool_choice_structured_outputs(TOOLS, choice) is None
        assert tool_choice_parser(choice) is None


def test_required_schema_shape() -> None:
    schema = required_schema(tool_parameters(TOOLS), parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    calls = schema["items"]["anyOf"]
    assert [c["properties"]["name"] for c in calls] == [
        {"const": n} for n in ("get_weather", "search", "now")
    ]
    assert calls[0]["properties"]["arguments"] == WEATHER
    assert calls[2]["properties"]["arguments"] == {  # no parameters: no arguments
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    assert all(c["required"] == ["name", "arguments"] and c["additionalProperties"] is False for c in calls)
    # $defs moved to the top, where "#/$defs/short" resolves
    assert "$defs" not in calls[1]["properties"]["arguments"]
    assert schema["$defs"] == {"short": {"type": "string", "maxLength": 8}}
    assert SEARCH["$defs"]  # the request's tools are left as they were
    one = required_schema(tool_parameters(TOOLS[:1]), parallel=False)
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"] == {"const": "get_weather"}


def test_required_and_named_constraints() -> None:
    params = tool_choice_structured_outputs(TOOLS, "required", parallel_tool_calls=None)
    assert params is not None and params.json == required_schema(tool_parameters(TOOLS), parallel=True)
    named = {"type": "function", "function": {"name": "search"}}
    assert tool_choice_structured_outputs(TOOLS, named) == StructuredOutputsParams(json=SEARCH)
    responses_style = {"type": "function", "name": "get_weather"}
    assert tool_choice_structured_outputs(TOOLS, responses_style) == StructuredOutputsParams(json=WEATHER)
    assert isinstance(tool_choice_parser("required"), JsonArrayToolParser)
    parser = tool_choice_parser(named)
    assert isinstance(parser, NamedToolParser) and parser.function_name == "search"


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function", "function": {}}, "tool_choice"),
        ([], "required", "tool_choice"),
        (None, "required", "tool_choice"),
        ([tool("a"), "not a tool"], "required", "tools[1]"),
        ([{"type": "retrieval"}], "required", "tools[0]"),
        ([{"type": "function", "function": {"name": ""}}], "required", "tools[0].function"),
        ([tool("a", [1, 2])], "required", "tools[0].function.parameters"),  # type: ignore[arg-type]
        ([tool("a"), tool("a")], "required", "tools[1].function.name"),
        ([tool("a", {"type": "object", "properties": {"x": {"type": "nope"}}})], "required", "tools"),
        (
            [tool("a", {"type": "object", "properties": {"x": {"type": "nope"}}})],
            {"type": "function", "function": {"name": "a"}},
            "tools[0].function.parameters",
        ),
        ([tool("a", {"$ref": "#"})], "required", "tools[0].function.parameters"),  # the root moves
        (
            [
                tool("a", {"$defs": {"d": {"type": "string"}}}),
                tool("b", {"$defs": {"d": {"type": "integer"}}}),
            ],
            "required",
            "tools[1].function.parameters",
        ),
    ],
)
def test_bad_tools_and_choices_name_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(StructuredOutputError) as info:
        tool_choice_structured_outputs(tools, choice)
    assert info.value.param == param


def test_shared_identical_defs_are_fine() -> None:
    defs = {"$defs": {"d": {"type": "string"}}}
    tools = [tool("a", {**defs, "properties": {"x": {"$ref": "#/$defs/d"}}}), tool("b", dict(defs))]
    params = tool_choice_structured_outputs(tools, "required")
    assert params is not None and params.json["$defs"] == {"d": {"type": "string"}}  # type: ignore[index]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("parallel", [True, False])
def test_required_end_to_end(
    compiler: GrammarCompiler, generate: Generate, seed: int, parallel: bool
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    params = tool_choice_structured_outputs(TOOLS, "required", parallel_tool_calls=parallel)
    assert params is not None
    text = generate(compiler, params, seed)
    parser = tool_choice_parser("required")
    assert parser is not None
    result = parser.extract(text)
    assert result.content is None and len(result.tool_calls) >= 1
    if not parallel:
        assert len(result.tool_calls) == 1
    by_name = tool_parameters(TOOLS)
    for call in result.tool_calls:
        arguments = json.loads(call.function.arguments)
        schema = {**by_name[call.function.name], "$defs": SEARCH["$defs"]}
        jsonschema.validate(arguments, schema)
    stream = parser.stream()
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])] + stream.finish()
    streamed = [(t.function.name, t.function.arguments) for d in deltas for t in d.tool_calls or [] if t.id]
    assert [name for name, _ in streamed] == [c.function.name for c in result.tool_calls]


@pytest.mark.parametrize("seed", range(5))
def test_named_end_to_end(compiler: GrammarCompiler, generate: Generate, seed: int) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    params = tool_choice_structured_outputs(TOOLS, choice)
    assert params is not None
    text = generate(compiler, params, seed)
    parser = tool_choice_parser(choice)
    assert parser is not None
    [call] = parser.extract(text).tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
