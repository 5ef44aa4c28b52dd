"""The constraint a completion request asks for, from whichever of its spellings the client used.

vLLM's `structured_outputs` object, its older top-level aliases guided_json / guided_regex /
guided_choice / guided_grammar (with guided_whitespace_pattern), and OpenAI's `response_format`
({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}). At most one
spelling per request: two are a 400 naming the second, rather than a guess at which one wins.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from asyncengine.structured_output.errors import StructuredOutputError
from asyncengine.structured_output.spec import StructuredOutputsParams

FIELD_IN_ERROR = re.compile(r"at `\$\.(\w+)")
ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}


def structured_outputs_from_request(
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None,
    response_format: dict[str, Any] | None = None,
    **guided: Any,
) -> StructuredOutputsParams | None:
    """The request's validated constraint, or None for free text; StructuredOutputError otherwise.

    `guided` takes the alias fields as the request holds them (None for absent); any other keyword is a
    programming error (TypeError)."""
    unknown = set(guided) - set(ALIASES)
    if unknown:
        raise TypeError(f"unknown structured-output fields: {sorted(unknown)}")
    sources: list[tuple[str, StructuredOutputsParams, dict[str, str]]] = []
    if structured_outputs is not None:
        sources.append(("structured_outputs", _convert(structured_outputs), {}))
    if response_format is not None:
        params = _from_response_format(response_format)
        if params is not None:
            param = "response_format.json_schema.schema" if params.json is not None else "response_format"
            sources.append(("response_format", params, {"json": param, "json_object": "response_format"}))
    given = {k: v for k, v in guided.items() if v is not None}
    if given:
        fields = {ALIASES[k]: v for k, v in given.items()}
        try:
            params = msgspec.convert(fields, StructuredOutputsParams)
        except msgspec.ValidationError as e:
            raise StructuredOutputError(str(e), _alias_of(str(e), given)) from e
        sources.append((sorted(given)[0], params, {ALIASES[k]: k for k in given}))
    if not sources:
        return None
    if len(sources) > 1:
        raise StructuredOutputError(
            f"set one structured-output constraint, got {sources[0][0]} and {sources[1][0]}", sources[1][0]
        )
    _, params, names = sources[0]
    params.validate(names)
    return params


def _convert(value: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
    if isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise StructuredOutputError("must be an object", "structured_outputs")
    try:
        return msgspec.convert(value, StructuredOutputsParams)
    except msgspec.ValidationError as e:  # "Expected `str | null`, got `int` - at `$.regex`"
        field = _field_of(str(e))
        raise StructuredOutputError(
            str(e), f"structured_outputs.{field}" if field else "structured_outputs"
        ) from e


def _field_of(message: str) -> str | None:
    """The top-level field msgspec's ValidationError names ("... - at `$.regex`")."""
    match = FIELD_IN_ERROR.search(message)
    return match.group(1) if match else None


def _alias_of(message: str, given: dict[str, Any]) -> str:
    field = _field_of(message)
    return next((k for k in given if ALIASES[k] == field), sorted(given)[0])


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    if not isinstance(response_format, dict):
        raise StructuredOutputError("must be an object", "response_format")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredOutputError("must be an object", "response_format.json_schema")
        schema = spec.get("schema")
        if schema is None:  # OpenAI makes `schema` optional: then any JSON object
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise StructuredOutputError("must be a JSON schema object", "response_format.json_schema.schema")
        return StructuredOutputsParams(json=schema)
    raise StructuredOutputError(
        f"unsupported type {kind!r} (text, json_object or json_schema)", "response_format.type"
    )
