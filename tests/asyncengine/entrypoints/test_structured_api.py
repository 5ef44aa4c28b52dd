"""Structured output on /v1/completions, /v1/chat/completions and the websocket, in-process over a
scripted engine: every spelling (response_format, structured_outputs, guided_*) reaches the engine as
SamplingParams.structured_outputs; bad ones are 400s naming the part to blame, before the engine sees
them, and a grammar error the engine raises at the first iteration (a large spec compiled off its loop)
is a 400 too, streamed or not."""

from __future__ import annotations

from typing import Any

import pytest
from scripted_engine import ScriptedEngine, http

from asyncengine.config import default_model_path
from asyncengine.structured_output import StructuredOutputError, StructuredOutputsParams
from asyncengine.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(60)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(default_model_path())


def post(engine: ScriptedEngine, path: str, body: dict[str, Any]) -> Any:
    prompt = {"messages": HI} if path == "/v1/chat/completions" else {"prompt": "x"}
    return http(engine).post(path, json={**prompt, "max_tokens": 8, **body})


PATHS = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "fields, expected",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
        ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
        ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutputsParams(grammar='root ::= "a" | "b"')),
        (
            {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
            StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?"),
        ),
        ({}, None),
    ],
)
def test_every_spelling_reaches_the_engine(
    tokenizer: Any, path: str, fields: dict[str, Any], expected: StructuredOutputsParams | None
) -> None:
    engine = ScriptedEngine(['{"a": 1}'], tokenizer=tokenizer)
    r = post(engine, path, fields)
    assert r.status_code == 200, r.text
    assert engine.params[-1].structured_outputs == expected


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": 3}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_choice": "yes"}, "guided_choice"),  # a list of strings (pydantic's check)
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_constraints_name_their_param(
    tokenizer: Any, path: str, fields: dict[str, Any], param: str
) -> None:
    engine = ScriptedEngine(["x"], tokenizer=tokenizer)
    r = post(engine, path, fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert not engine.params  # refused before the engine saw it


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_grammar_error_is_a_400(tokenizer: Any, path: str, stream: bool) -> None:
    """The engine compiles a large spec off its loop and raises its error at the first iteration."""
    error = StructuredOutputError("grammar too large to compile in 2 s", "structured_outputs.grammar")
    engine = ScriptedEngine(["x"], tokenizer=tokenizer, error=error)
    r = post(engine, path, {"structured_outputs": {"grammar": 'root ::= "a"'}, "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs.grammar"
    assert "too large" in r.json()["error"]["message"]


def ws_run(engine: ScriptedEngine, frame: dict[str, Any]) -> list[dict[str, Any]]:
    with http(engine).websocket_connect("/v1/ws") as ws:
        ws.send_json({"type": "generate", "request_id": "r", **frame})
        frames = [ws.receive_json()]
        while frames[-1]["type"] not in ("done", "error"):
            frames.append(ws.receive_json())
    return frames


def test_websocket_params_take_structured_outputs(tokenizer: Any) -> None:
    engine = ScriptedEngine(["yes"], tokenizer=tokenizer)
    frames = ws_run(engine, {"prompt": "x", "params": {"structured_outputs": {"choice": ["yes", "no"]}}})
    assert frames[-1]["type"] == "done" and "".join(f["text"] for f in frames[:-1]) == "yes"
    assert engine.params[-1].structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    ws_run(engine, {"messages": HI, "params": {"structured_outputs": {"json": SCHEMA}}})
    assert engine.params[-1].structured_outputs == StructuredOutputsParams(json=SCHEMA)


@pytest.mark.parametrize(
    "structured, param",
    [
        ({"regex": "("}, "structured_outputs.regex"),
        ({"regex": 1}, "structured_outputs.regex"),
        ({"regex": "a", "json": SCHEMA}, "structured_outputs.regex"),
        ("a", "structured_outputs"),
    ],
)
def test_websocket_bad_structured_outputs_name_their_param(
    tokenizer: Any, structured: Any, param: str
) -> None:
    engine = ScriptedEngine(["x"], tokenizer=tokenizer)
    (error,) = ws_run(engine, {"prompt": "x", "params": {"structured_outputs": structured}})
    assert error["type"] == "error" and error["code"] == 400 and error["param"] == param, error


def test_websocket_engine_grammar_error_is_an_error_frame(tokenizer: Any) -> None:
    error = StructuredOutputError("grammar too large", "structured_outputs.grammar")
    engine = ScriptedEngine(["x"], tokenizer=tokenizer, error=error)
    (frame,) = ws_run(engine, {"prompt": "x", "params": {"structured_outputs": {"grammar": 'root ::= "a"'}}})
    assert frame["code"] == 400 and frame["param"] == "structured_outputs.grammar", frame
