"""Structured output and tool calling end to end: `asyncengine serve` on a tiny random model, driven by the
openai SDK and the websocket. The weights alone write garbage, so the grammar is all that makes an output
valid: every output that finished by itself must parse and match its schema, pattern or choices."""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_process import API_KEY, ServerProcess
from websockets.asyncio.client import connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
try:
    import jsonschema
except ImportError:  # optional: without it the shape is checked by hand below
    jsonschema = None

ASK = [{"role": "user", "content": "hi"}]
MODEL = ""  # the served model (a request may leave it empty)
MAX_TOKENS = 120  # room for each bounded output below, so a "length" finish would be a failure
POINT = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 6},
        "x": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["label", "x", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "now", "strict": True}},
]
PARAMETERS = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}}}


def sdk(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def check(value: Any, schema: dict[str, Any]) -> None:
    if jsonschema is not None:
        jsonschema.validate(value, schema)
    else:
        assert isinstance(value, dict) and set(value) <= set(schema.get("properties", {})), value


def valid_calls(tool_calls: Any) -> list[tuple[str, Any]]:
    """The calls as (name, arguments), each with OpenAI's id and arguments valid for its tool."""
    assert tool_calls
    calls = []
    for call in tool_calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id) and call.type == "function"
        arguments = json.loads(call.function.arguments)
        check(arguments, PARAMETERS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def check_calls(message: Any, finish_reason: str, most: int | None = None) -> list[tuple[str, Any]]:
    """A finished answer of calls alone: no content, finish_reason "tool_calls", valid calls."""
    assert finish_reason == "tool_calls" and message.content is None, (finish_reason, message)
    assert most is None or len(message.tool_calls) <= most
    return valid_calls(message.tool_calls)


def test_json_schema_response_format(server: ServerProcess) -> None:
    client = sdk(server)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "point", "schema": POINT, "strict": True},
    }
    for seed in range(3):
        chat = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format=response_format,
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
            n=2,
        )
        for choice in chat.choices:
            assert choice.finish_reason == "stop", choice
            check(json.loads(choice.message.content), POINT)
    done = client.completions.create(
        model=MODEL, prompt="p", max_tokens=MAX_TOKENS, temperature=0, extra_body={"guided_json": POINT}
    )
    assert done.choices[0].finish_reason == "stop"
    check(json.loads(done.choices[0].text), POINT)


def test_regex_and_choice(server: ServerProcess) -> None:
    client = sdk(server)
    pattern = r"[a-c]{2}-[0-9]{3}"
    for seed in range(3):
        done = client.completions.create(
            model=MODEL,
            prompt="p",
            max_tokens=MAX_TOKENS,
            seed=seed,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        assert done.choices[0].finish_reason == "stop" and re.fullmatch(pattern, done.choices[0].text)
        chat = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=MAX_TOKENS,
            seed=seed,
            extra_body={"guided_choice": ["yes", "no", "maybe"]},
        )
        assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content in (
            "yes",
            "no",
            "maybe",
        )


def test_tool_choice_required_and_named(server: ServerProcess) -> None:
    client = sdk(server)
    # one call: the grammar ends the output after it
    for seed in range(3):
        chat = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
            max_tokens=MAX_TOKENS,
        )
        check_calls(chat.choices[0].message, chat.choices[0].finish_reason, most=1)
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=MAX_TOKENS
    )
    calls = check_calls(chat.choices[0].message, chat.choices[0].finish_reason)
    assert [name for name, _ in calls] == ["get_weather"]
    # parallel calls: a random model may go on adding calls up to max_tokens; those it wrote are valid
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS
    )
    assert chat.choices[0].finish_reason in ("tool_calls", "length")
    valid_calls(chat.choices[0].message.tool_calls)


def test_streamed_tool_calls_match_the_whole_answer(server: ServerProcess) -> None:
    client = sdk(server)
    request = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    request |= {"parallel_tool_calls": False, "temperature": 0, "max_tokens": MAX_TOKENS}
    whole = client.chat.completions.create(**request).choices[0]
    state = ChatCompletionStreamState(input_tools=TOOLS)  # the SDK's accumulator of .stream()
    for chunk in client.chat.completions.create(stream=True, **request):
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert check_calls(final.message, final.finish_reason) == check_calls(whole.message, whole.finish_reason)
    for call in final.message.tool_calls:  # parsed by the SDK against the strict tools
        assert call.function.parsed_arguments == json.loads(call.function.arguments)


def test_errors_are_400_with_param(server: ServerProcess) -> None:
    client = sdk(server)
    cases = [
        ({"extra_body": {"structured_outputs": {"regex": "("}}}, "structured_outputs.regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}}},
            "response_format.json_schema.schema",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
        assert e.value.body["param"] == param, e.value.body


async def test_websocket_structured_outputs_and_tools(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with connect(server.ws_url, additional_headers=headers, open_timeout=20) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "request_id": "j",
                    "prompt": "p",
                    "params": {"max_tokens": MAX_TOKENS, "seed": 0, "structured_outputs": {"json": POINT}},
                }
            )
        )
        await ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "request_id": "t",
                    "messages": ASK,
                    "tools": TOOLS,
                    "tool_choice": "required",
                    "parallel_tool_calls": False,
                    "params": {"max_tokens": MAX_TOKENS, "seed": 1},
                }
            )
        )
        text: dict[str, str] = {"j": "", "t": ""}
        done: dict[str, dict[str, Any]] = {}
        while len(done) < 2:
            frame = json.loads(await ws.recv())
            assert frame["type"] in ("delta", "done"), frame
            if frame["type"] == "delta":
                text[frame["request_id"]] += frame["text"]
            else:
                done[frame["request_id"]] = frame
    assert done["j"]["finish_reason"] == "stop"
    check(json.loads(text["j"]), POINT)
    assert done["t"]["finish_reason"] == "tool_calls" and text["t"] == ""
    for call in done["t"]["tool_calls"]:
        check(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])
