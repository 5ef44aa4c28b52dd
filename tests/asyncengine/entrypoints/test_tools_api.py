"""Tool calling on /v1/chat/completions and the websocket, in-process over a scripted engine: the request's
tools and tool_choice (the constraint the engine gets, the template's tools, the 400s naming the field),
and the model's text read back as OpenAI's tool_calls, whole and streamed (checked with the openai SDK's
stream accumulator). The bundled model's chat template (Hermes tool format) is the template here, so
tool_choice "auto" picks the hermes parser as a real server would."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import transformers
from openai.lib.streaming.chat import ChatCompletionStreamState
from scripted_engine import ScriptedEngine, http, sdk

from asyncengine.config import default_model_path
from asyncengine.entrypoints.tool_parsers import required_schema
from asyncengine.entrypoints.tool_parsers.tool_choice import tool_parameters
from asyncengine.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(60)
CALL_ID = re.compile(r"^call_[A-Za-z0-9]{24}$")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather",
            "parameters": WEATHER,
            "strict": True,
        },
    },
    {"type": "function", "function": {"name": "now", "strict": True}},
]
ASK = [{"role": "user", "content": "weather in Paris?"}]
REQUIRED_TEXT = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]'
HERMES_TEXT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
EXPECTED = [("get_weather", {"city": "Paris"}), ("now", {})]
M = "fake-model"
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}
BAD_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]
PARIS = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(default_model_path())  # ChatML with Hermes tools: "auto" reads <tool_call>


def calls_of(message: Any) -> list[tuple[str, Any]]:
    for call in message.tool_calls:
        assert CALL_ID.match(call.id) and call.type == "function", call
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def streamed(api: Any, **request: Any) -> tuple[Any, list[Any]]:
    """The SDK's own accumulation of a streamed chat (ChatCompletionStreamState, what
    client.chat.completions.stream() runs), and the raw chunks."""
    state = ChatCompletionStreamState(input_tools=request.get("tools", []))
    chunks = list(api.chat.completions.create(stream=True, **request))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion(), chunks


# -- tool_choice "required" and named: the constrained output becomes tool_calls ------------------------
def test_required_gives_tool_calls_and_constrains_the_output(tokenizer: Any) -> None:
    engine = ScriptedEngine([REQUIRED_TEXT], tokenizer=tokenizer)
    chat = sdk(engine).chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice="required")
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls_of(choice.message) == EXPECTED
    expected = required_schema(tool_parameters(TOOLS), parallel=True)
    assert engine.params[-1].structured_outputs.json == expected
    # the template saw the tools (the model is told what it may call)
    prompt = tokenizer.decode(engine.prompts[-1])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt


def test_parallel_tool_calls_false_allows_one_call(tokenizer: Any) -> None:
    engine = ScriptedEngine([REQUIRED_TEXT], tokenizer=tokenizer)
    sdk(engine).chat.completions.create(
        model=M, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert engine.params[-1].structured_outputs.json["maxItems"] == 1


def test_named_tool_gives_that_call(tokenizer: Any) -> None:
    engine = ScriptedEngine(['{"city": "Rome", "unit": "celsius"}'], tokenizer=tokenizer)
    chat = sdk(engine).chat.completions.create(
        model=M,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        n=2,
    )
    assert engine.params[-1].structured_outputs.json == WEATHER
    for choice in chat.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert calls_of(choice.message) == [("get_weather", {"city": "Rome", "unit": "celsius"})]
    assert chat.choices[0].message.tool_calls[0].id != chat.choices[1].message.tool_calls[0].id


def test_a_call_cut_short_keeps_finish_reason_length(tokenizer: Any) -> None:
    engine = ScriptedEngine(['{"city": "Ro'], tokenizer=tokenizer, finish_reason="length")
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = sdk(engine).chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice=named)
    assert chat.choices[0].finish_reason == "length"  # the client sees the call may be incomplete
    stream = sdk(engine).chat.completions.create(
        model=M, messages=ASK, tools=TOOLS, tool_choice=named, stream=True
    )
    assert [c.choices[0].finish_reason for c in stream][-1] == "length"


# -- "auto": the model's own format, parsed by the template's parser (hermes here) ----------------------
def test_auto_separates_text_and_calls(tokenizer: Any) -> None:
    engine = ScriptedEngine([HERMES_TEXT], tokenizer=tokenizer)
    chat = sdk(engine).chat.completions.create(model=M, messages=ASK, tools=TOOLS)  # auto by default
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert calls_of(choice.message) == [EXPECTED[0]]
    assert engine.params[-1].structured_outputs is None  # nothing is forced


def test_auto_without_calls_is_plain_text(tokenizer: Any) -> None:
    text = "No tool needed. <tool_call> is how I would call one."
    engine = ScriptedEngine([text], tokenizer=tokenizer)
    chat = sdk(engine).chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice="auto")
    assert chat.choices[0].message.content == text and chat.choices[0].message.tool_calls is None
    assert chat.choices[0].finish_reason == "stop"
    final, _ = streamed(sdk(engine), model=M, messages=ASK, tools=TOOLS, tool_choice="auto")
    assert final.choices[0].message.content == text and not final.choices[0].message.tool_calls


def test_tool_call_parser_flag_none_leaves_text(tokenizer: Any) -> None:
    engine = ScriptedEngine([HERMES_TEXT], tokenizer=tokenizer)
    chat = sdk(engine, tool_call_parser="none").chat.completions.create(model=M, messages=ASK, tools=TOOLS)
    assert chat.choices[0].message.content == HERMES_TEXT and chat.choices[0].finish_reason == "stop"


def test_tool_call_parser_flag_picks_the_parser(tokenizer: Any) -> None:
    engine = ScriptedEngine(['{"name": "now", "parameters": {}}'], tokenizer=tokenizer)
    api = sdk(engine, tool_call_parser="llama3_json")
    chat = api.chat.completions.create(model=M, messages=ASK, tools=TOOLS)
    assert calls_of(chat.choices[0].message) == [("now", {})]


def test_none_answers_text_and_hides_the_tools(tokenizer: Any) -> None:
    engine = ScriptedEngine([HERMES_TEXT], tokenizer=tokenizer)
    chat = sdk(engine).chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice="none")
    assert chat.choices[0].message.content == HERMES_TEXT and chat.choices[0].message.tool_calls is None
    assert "<tools>" not in tokenizer.decode(engine.prompts[-1])


def test_history_with_calls_and_results_reaches_the_template(tokenizer: Any) -> None:
    engine = ScriptedEngine(["It is sunny."], tokenizer=tokenizer)
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    chat = sdk(engine).chat.completions.create(model=M, messages=history, tools=TOOLS)
    assert chat.choices[0].message.content == "It is sunny."
    prompt = tokenizer.decode(engine.prompts[-1])
    # as transformers renders it: the arguments as an object, the Hermes tags
    hf = transformers.AutoTokenizer.from_pretrained(default_model_path())
    template_history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [PARIS]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    expected = hf.apply_chat_template(
        template_history, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert prompt == expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert tokenizer._hf is None  # FastTokenizer rendered the dict tools itself, loading no transformers


def test_plain_chat_renders_as_before(tokenizer: Any) -> None:
    """The bundled template with tools support renders a chat without tools as plain ChatML."""
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, *ASK], add_generation_prompt=True, tokenize=False
    )
    chatml = "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nweather in Paris?<|im_end|>\n"
    assert text == chatml + "<|im_start|>assistant\n"


# -- streaming --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, tool_choice, content",
    [
        (REQUIRED_TEXT, "required", None),
        ('{"city": "Paris"}', {"type": "function", "function": {"name": "get_weather"}}, None),
        (HERMES_TEXT, "auto", "Let me look."),
    ],
)
def test_streamed_calls_add_up_to_the_whole_answer(
    tokenizer: Any, text: str, tool_choice: Any, content: str | None
) -> None:
    engine = ScriptedEngine([text], tokenizer=tokenizer, pieces=2)
    api = sdk(engine)
    request = {"model": M, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice}
    whole = api.chat.completions.create(**request).choices[0]
    final, chunks = streamed(api, **request)
    choice = final.choices[0]
    assert choice.finish_reason == whole.finish_reason == "tool_calls"
    assert calls_of(choice.message) == calls_of(whole.message)
    assert (choice.message.content or None) == content == whole.message.content
    for call in choice.message.tool_calls:  # the SDK parsed the strict tools' arguments itself
        assert call.function.parsed_arguments == json.loads(call.function.arguments)
    # OpenAI's shape: role first; each call's first delta has id, type, name and arguments ""; then only
    # index and argument fragments; finish_reason on the last chunk alone
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    firsts = [t for d in deltas for t in d.tool_calls or [] if t.id is not None]
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in firsts] == [
        (i, "function", name, "") for i, (name, _) in enumerate(calls_of(whole.message))
    ]
    fragments = [t for d in deltas for t in d.tool_calls or [] if t.id is None]
    assert fragments and all(t.function.name is None and t.type is None for t in fragments)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_streamed_n_choices_have_their_own_calls(tokenizer: Any) -> None:
    engine = ScriptedEngine([REQUIRED_TEXT, '[{"name": "now", "arguments": {}}]'], tokenizer=tokenizer)
    final, _ = streamed(sdk(engine), model=M, messages=ASK, tools=TOOLS, tool_choice="required", n=2)
    assert [calls_of(c.message) for c in final.choices] == [EXPECTED, [("now", {})]]


# -- bad requests: 400 naming the field ---------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "combined",
        ),
        ({"tools": BAD_TOOLS, "tool_choice": "required"}, "tools", "strin"),
        (
            {"tools": BAD_TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tools[0].function.parameters",
            "strin",
        ),
        ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name", "duplicate"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 1}}]}, "tools", "object"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "empty"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools", "only function tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools", "colour"),
    ],
)  # fmt: skip
def test_bad_tool_requests_name_the_field(
    tokenizer: Any, fields: dict[str, Any], param: str, words: str
) -> None:
    engine = ScriptedEngine(["x"], tokenizer=tokenizer)
    r = http(engine).post("/v1/chat/completions", json={"messages": ASK, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert not engine.params  # refused before it reached the engine


def test_tokenize_renders_the_tools(tokenizer: Any) -> None:
    c = http(ScriptedEngine(["x"], tokenizer=tokenizer))
    r = c.post("/tokenize", json={"messages": ASK, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert "<tools>" in tokenizer.decode(r.json()["tokens"])


# -- the websocket ------------------------------------------------------------------------------------
def ws_run(c: Any, frame: dict[str, Any]) -> list[dict[str, Any]]:
    with c.websocket_connect("/v1/ws") as ws:
        ws.send_json({"type": "generate", "request_id": "r", **frame})
        frames = [ws.receive_json()]
        while frames[-1]["type"] not in ("done", "error"):
            frames.append(ws.receive_json())
    return frames


def test_websocket_streams_tool_calls(tokenizer: Any) -> None:
    engine = ScriptedEngine([HERMES_TEXT], tokenizer=tokenizer)
    frames = ws_run(http(engine), {"messages": ASK, "tools": TOOLS, "params": {"max_tokens": 50}})
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in done["tool_calls"]] == [
        EXPECTED[0]
    ]
    assert CALL_ID.match(done["tool_calls"][0]["id"]) and done["tool_calls"][0]["type"] == "function"
    assert "".join(f["text"] for f in frames[:-1]) == "Let me look."  # the content alone
    deltas = [d for f in frames[:-1] for d in f.get("tool_calls", [])]
    assert deltas[0] == {
        "index": 0,
        "id": done["tool_calls"][0]["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert (
        "".join(d["function"]["arguments"] for d in deltas) == done["tool_calls"][0]["function"]["arguments"]
    )


def test_websocket_required_tool_choice_constrains(tokenizer: Any) -> None:
    engine = ScriptedEngine([REQUIRED_TEXT], tokenizer=tokenizer)
    frames = ws_run(http(engine), {"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
    assert engine.params[-1].structured_outputs.json == required_schema(tool_parameters(TOOLS), True)
    done = frames[-1]
    assert done["finish_reason"] == "tool_calls"
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in done["tool_calls"]
    ] == EXPECTED


def test_websocket_accepts_tool_history(tokenizer: Any) -> None:
    engine = ScriptedEngine(["ok"], tokenizer=tokenizer)
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
        ]},
        {"role": "tool", "content": "noon", "tool_call_id": "c1"},
    ]  # fmt: skip
    frames = ws_run(http(engine), {"messages": history, "tools": TOOLS, "tool_choice": "none"})
    assert (
        frames[-1]["type"] == "done"
        and frames[-1]["finish_reason"] == "stop"
        and "tool_calls" not in frames[-1]
    )
    prompt = tokenizer.decode(engine.prompts[-1])
    assert '{"name": "now", "arguments": {}}' in prompt and "noon" in prompt and "<tools>" not in prompt


@pytest.mark.parametrize(
    "frame, param, words",
    [
        ({"prompt": "p", "tools": TOOLS}, "tools", "goes with messages"),
        ({"prompt": "p", "tool_choice": "auto"}, "tool_choice", "goes with messages"),
        ({"messages": ASK, "tools": TOOLS, "tool_choice": {"name": "y"}}, "tool_choice", "'y'"),
        ({"messages": ASK, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"messages": ASK, "tools": [{"type": "function"}]}, "tools", "only function tools"),
        ({"messages": ASK, "tools": "x"}, "tools", "list"),
        (
            {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
            | {"params": {"structured_outputs": {"regex": "a"}}},
            "tool_choice",
            "combined",
        ),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages", "content must be a string"),
        ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages", "tool_calls"),
    ],
)  # fmt: skip
def test_websocket_bad_tool_frames(tokenizer: Any, frame: dict[str, Any], param: str, words: str) -> None:
    engine = ScriptedEngine(["x"], tokenizer=tokenizer)
    (error,) = ws_run(http(engine), frame)
    assert error["type"] == "error" and error["code"] == 400 and error["param"] == param, error
    assert words in error["message"], error


# -- the --tool-call-parser flag ------------------------------------------------------------------------
def test_tool_call_parser_flag_reaches_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncengine.entrypoints import cli, launcher
    from asyncengine.entrypoints.tool_parsers import HermesToolParser, pick_parser

    for value in cli.TOOL_CALL_PARSERS:  # every choice is one the server knows ("auto": the template's)
        if value != "auto":
            pick_parser(None, value)
    assert isinstance(pick_parser(None, "hermes"), HermesToolParser) and pick_parser(None, "none") is None
    seen: list[launcher.ServeOptions] = []
    monkeypatch.setattr(launcher, "run", lambda config, opts: seen.append(opts) or 0)
    parser = cli.build_parser()
    for argv, expected in (
        (["serve"], "auto"),
        (["serve", "--tool-call-parser", "llama3_json"], "llama3_json"),
    ):
        args = parser.parse_args(argv)
        assert args.func(args) == 0 and seen[-1].tool_call_parser == expected
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "mistral"])
