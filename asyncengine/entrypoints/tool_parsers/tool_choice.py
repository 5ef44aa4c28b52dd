"""tool_choice "required" and a named tool: the constraint the output is generated under, and its parser.

The constrained output is not the model's own call syntax but plain JSON (vLLM's choice too):
  - "required": a JSON array of one or more calls (exactly one if parallel_tool_calls is false), each
    {"name": <one of the tools>, "arguments": <that tool's parameters schema>}; JsonArrayToolParser.
    "arguments", not vLLM's "parameters": it is OpenAI's word and Hermes / Qwen's, the call format
    most chat models were trained on, so the forced text is the likeliest to them.
  - a named tool: just that tool's arguments object; NamedToolParser gives it the name.
One format for every model keeps the grammar and parser independent of the chat template; the
model's native syntax is only needed for "auto", where nothing is forced (pick_parser).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

from asyncengine.entrypoints.tool_parsers.base import ToolParser
from asyncengine.entrypoints.tool_parsers.json_array import JsonArrayToolParser
from asyncengine.entrypoints.tool_parsers.named import NamedToolParser
from asyncengine.entrypoints.tool_parsers.protocol import make_tool_call_id
from asyncengine.structured_output.errors import StructuredOutputError
from asyncengine.structured_output.spec import StructuredOutputsParams

# a function without `parameters` takes none (OpenAI: "an empty parameter list"): {} and nothing else
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
DEFINITION_KEYS = ("$defs", "definitions")


def tool_parameters(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of OpenAI's tools list; StructuredOutputError naming the bad entry."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise StructuredOutputError('must be {"type": "function", "function": {...}}', where)
        function = tool.get("function")
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise StructuredOutputError("must have a function with a name", f"{where}.function")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise StructuredOutputError("must be a JSON schema object", f"{where}.function.parameters")
        if function["name"] in out:
            raise StructuredOutputError(f"duplicate tool name {function['name']!r}", f"{where}.function.name")
        out[function["name"]] = parameters
    return out


def named_tool(tool_choice: Any) -> str | None:
    """The tool a named tool_choice names ({"type": "function", "function": {"name": ...}}, or the
    Responses API's {"type": "function", "name": ...}); None for "none" / "auto" / "required"."""
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return name
    raise StructuredOutputError(
        'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}', "tool_choice"
    )


def tool_choice_structured_outputs(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None = True
) -> StructuredOutputsParams | None:
    """The constraint for "required" or a named tool (validated); None for "none" / "auto"."""
    parameters = tool_parameters(tools)
    name = named_tool(tool_choice)
    if name is not None:
        if name not in parameters:
            raise StructuredOutputError(f"names {name!r}, which is not in tools", "tool_choice")
        params = StructuredOutputsParams(json=parameters[name])
        params.validate({"json": f"tools[{list(parameters).index(name)}].function.parameters"})
        return params
    if tool_choice != "required":
        return None
    if not parameters:
        raise StructuredOutputError('"required" needs tools', "tool_choice")
    params = StructuredOutputsParams(json=required_schema(parameters, parallel_tool_calls is not False))
    params.validate({"json": "tools"})
    return params


def required_schema(parameters: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls [{"name": ..., "arguments": ...}, ...]; each tool's $defs / definitions
    move to the top, where their "#/$defs/..." references now point."""
    definitions: dict[str, dict[str, Any]] = {}
    calls = []
    for index, (name, schema) in enumerate(parameters.items()):
        schema = copy.deepcopy(schema)
        where = f"tools[{index}].function.parameters"
        for ref in _refs(schema):
            if ref.startswith("#") and not ref.startswith(tuple(f"#/{k}/" for k in DEFINITION_KEYS)):
                raise StructuredOutputError(
                    f'$ref {ref!r}: only "#/$defs/..." and "#/definitions/..." are supported with '
                    'tool_choice "required"',
                    where,
                )
        for key in DEFINITION_KEYS:
            for def_name, definition in (schema.pop(key, None) or {}).items():
                seen = definitions.setdefault(key, {}).setdefault(def_name, definition)
                if seen != definition:
                    raise StructuredOutputError(f"{key}/{def_name} differs from another tool's", where)
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    out: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not parallel:
        out["maxItems"] = 1
    out.update(definitions)
    return out


def _refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "$ref" and isinstance(item, str):
                yield item
            else:
                yield from _refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


def tool_choice_parser(
    tool_choice: Any, id_factory: Callable[[], str] = make_tool_call_id
) -> ToolParser | None:
    """The parser of what tool_choice_structured_outputs constrains to; None for "none" / "auto"
    (then the model's own format: pick_parser)."""
    name = named_tool(tool_choice)
    if name is not None:
        return NamedToolParser(name, id_factory)
    return JsonArrayToolParser(id_factory) if tool_choice == "required" else None
