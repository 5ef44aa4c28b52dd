"""Tool-call parsers: extract() on complete outputs, and streams that, however the text is cut into
deltas, add up to the same content and calls, in OpenAI's delta shapes."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable

import msgspec
import pytest

from asyncengine.entrypoints.tool_parsers import (
    DeltaMessage,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    ToolParser,
    pick_parser,
)
from asyncengine.errors import ConfigError

Calls = list[tuple[str, str]]


def counter() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def extracted(parser: ToolParser, text: str) -> tuple[str | None, Calls]:
    result = parser.extract(text)
    return result.content, [(c.function.name, c.function.arguments) for c in result.tool_calls]


def collect(deltas: list[DeltaMessage]) -> tuple[str | None, Calls]:
    """What a client makes of the deltas; checks their shapes on the way."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for d in deltas:
        assert (d.content is None) != (d.tool_calls is None), d  # one or the other
        if d.content is not None:
            assert d.content
            content.append(d.content)
            continue
        assert d.tool_calls is not None and len(d.tool_calls) == 1
        tc = d.tool_calls[0]
        if tc.id is not None:  # a call's first delta: id, type, name, arguments ""
            assert tc.index == len(calls) and tc.type == "function"
            assert tc.function.name and tc.function.arguments == ""
            calls[tc.index] = [tc.function.name, ""]
        else:  # then fragments of its arguments
            assert tc.type is None and tc.function.name is None and tc.function.arguments
            assert tc.index in calls
            calls[tc.index][1] += tc.function.arguments
    return ("".join(content) or None), [(name, args) for name, args in (calls[i] for i in sorted(calls))]


def streamed(parser: ToolParser, chunks: list[str]) -> tuple[str | None, Calls]:
    stream = parser.stream()
    deltas = [d for chunk in chunks for d in stream.feed(chunk)]
    return collect(deltas + stream.finish())


def assert_stream_agrees(parser: ToolParser, text: str) -> None:
    """Two chunks cut at every position, one character at a time, and random cuts: all as extract()."""
    expected = extracted(parser, text)
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]]) == expected, f"cut at {cut}: {text[:cut]!r}"
    assert streamed(parser, list(text)) == expected
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 5)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(parser, chunks) == expected, chunks


def canonical(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


# -- Hermes / Qwen ----------------------------------------------------------------------------------------
HERMES_CASES: list[tuple[str, str | None, Calls]] = [
    (
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "°C"}}\n</tool_call>',
        "Let me check both.",
        [
            ("get_weather", canonical({"city": "Paris", "days": 3})),
            ("get_weather", canonical({"city": "Rome", "unit": "°C"})),
        ],
    ),
    (  # compact JSON comes out in json.dumps's spacing; numbers as json.dumps writes them
        '<tool_call>{"name":"f","arguments":{"a":[1,2.50,1e2],"b":{"c":null}}}</tool_call>',
        None,
        [("f", canonical({"a": [1, 2.5, 100.0], "b": {"c": None}}))],
    ),
    ("No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("a partial tag at the end <tool_", "a partial tag at the end <tool_", []),
    (  # arguments before the name: held, then sent right after it
        '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>',
        None,
        [("search", canonical({"q": "x"}))],
    ),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),  # no arguments: {}
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None, [("f", '{"x": 1}')]),
    (  # extra members are ignored
        '<tool_call>{"type": "function", "id": 7, "name": "f", "arguments": {}}</tool_call>',
        None,
        [("f", "{}")],
    ),
    (  # the end tag inside an argument string is text
        '<tool_call>{"name": "echo", "arguments": {"s": "</tool_call> and <tool_call>"}}</tool_call>',
        None,
        [("echo", canonical({"s": "</tool_call> and <tool_call>"}))],
    ),
    (  # escapes and non-ASCII: as json.dumps(ensure_ascii=False) writes them
        '<tool_call>{"name": "say", "arguments": '
        '{"t": "line\\nnext \\"q\\" \\u00e9\\ud83d\\ude00 日本"}}</tool_call>',
        None,
        [("say", canonical({"t": 'line\nnext "q" é😀 日本'}))],
    ),
    (  # the model stopped before </tool_call>; a second call without the first's end tag
        '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {"x": 1}}',
        None,
        [("a", "{}"), ("b", '{"x": 1}')],
    ),
    (  # text between the object and </tool_call> is dropped; text after it is content
        '<tool_call>{"name": "a", "arguments": {}} oops</tool_call>\nDone.',
        "Done.",
        [("a", "{}")],
    ),
    ("Before <tool_call>not json</tool_call> after", "Before <tool_call>not json</tool_call> after", []),
    ('<tool_call>{"no_name": 1}</tool_call>', '<tool_call>{"no_name": 1}</tool_call>', []),
    (
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        [],
    ),
    ('<tool_call>["a"]</tool_call>', '<tool_call>["a"]</tool_call>', []),
    (  # a broken tag, then a good call: the broken one is text, the whitespace before the call goes
        "x <tool_call>oops \n<tool_call>\n" + '{"name": "a", "arguments": {}}\n</tool_call>',
        "x <tool_call>oops",
        [("a", "{}")],
    ),
    ("  \n<tool_call>\n" + '{"name": "a", "arguments": {}}\n</tool_call>\n  ', None, [("a", "{}")]),
    ("<tool_call>", "<tool_call>", []),  # cut off right after the tag
    ("Trailing spaces kept   ", "Trailing spaces kept   ", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_extract(text: str, content: str | None, calls: Calls) -> None:
    assert extracted(HermesToolParser(), text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_stream_agrees_at_every_split(text: str, content: str | None, calls: Calls) -> None:
    assert_stream_agrees(HermesToolParser(), text)


def test_hermes_call_broken_after_its_name() -> None:
    """Streamed: the name is out, and stays; extract(): the whole thing is content."""
    for text in (
        '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call> after',
        '<tool_call>{"name": "a", "arguments": {"x": 1, "x": 2}}</tool_call> after',
    ):
        assert extracted(HermesToolParser(), text) == (text, [])
        content, calls = streamed(HermesToolParser(), list(text))
        assert calls[0][0] == "a" and calls[0][1].startswith('{"x": ')
        assert content == "after"
    cut = '<tool_call>{"name": "a", "arguments": {"city": "Par'  # max_tokens
    assert extracted(HermesToolParser(), cut) == (cut, [])
    assert streamed(HermesToolParser(), [cut]) == (None, [("a", '{"city": "Par')])


def test_hermes_ids_and_delta_shapes() -> None:
    text = HERMES_CASES[0][0]
    parser = HermesToolParser(counter())
    assert [c.id for c in parser.extract(text).tool_calls] == ["call_0", "call_1"]
    stream = HermesToolParser(counter()).stream()
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    encoded = [msgspec.json.decode(msgspec.json.encode(d)) for d in deltas]
    first_call = next(i for i, e in enumerate(encoded) if "tool_calls" in e)
    assert "".join(e["content"] for e in encoded[:first_call]) == "Let me check both."
    assert encoded[first_call] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }
    assert encoded[first_call + 1] == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    fragments = [e["tool_calls"][0]["function"]["arguments"] for e in encoded if "tool_calls" in e]
    assert len(fragments) > 10  # the arguments stream as they come, not at the end
    # the default ids are OpenAI's shape and differ per call
    ids = [c.id for c in HermesToolParser().extract(text).tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_a_stream_takes_no_feed_after_finish() -> None:
    stream = HermesToolParser().stream()
    assert collect(stream.feed("hi <tool_") + stream.finish()) == ("hi <tool_", [])
    assert stream.finish() == []
    with pytest.raises(RuntimeError):
        stream.feed("x")


# -- Llama 3 ------------------------------------------------------------------------------------------------
LLAMA_CASES: list[tuple[str, str | None, Calls]] = [
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        None,
        [("get_weather", canonical({"city": "Paris"})), ("get_time", canonical({"tz": "CET"}))],
    ),
    (
        '\n {"name": "f", "parameters": {"x": [1, {"y": null}]}}',
        None,
        [("f", canonical({"x": [1, {"y": None}]}))],
    ),
    ('{"name": "f", "arguments": {"x": 1}}', None, [("f", '{"x": 1}')]),
    ('{"type": "function", "name": "f", "parameters": {}}', None, [("f", "{}")]),
    ('{"name": "f", "parameters": {}};', None, [("f", "{}")]),  # a trailing ";"
    ('{"name": "f", "parameters": {}}\n\nThat is all.', "That is all.", [("f", "{}")]),
    ('{"name": "f", "parameters": {}}; {"not": "a call"}', '; {"not": "a call"}', [("f", "{}")]),
    ("The answer is 42.", "The answer is 42.", []),
    ("  indented text", "  indented text", []),
    ("<|python_tag|>import math\nprint(math.pi)", "<|python_tag|>import math\nprint(math.pi)", []),
    ('{"just": "json"}', '{"just": "json"}', []),
    ("<|python_ta", "<|python_ta", []),
    ("<|python_tag|>", "<|python_tag|>", []),
    ("   ", "   ", []),
    ("", None, []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_extract(text: str, content: str | None, calls: Calls) -> None:
    assert extracted(Llama3JsonToolParser(), text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_stream_agrees_at_every_split(text: str, content: str | None, calls: Calls) -> None:
    assert_stream_agrees(Llama3JsonToolParser(), text)


def test_llama3_content_streams_without_waiting_for_the_end() -> None:
    stream = Llama3JsonToolParser().stream()
    assert stream.feed("  ") == []  # undecided: calls or text
    assert collect(stream.feed("Hello")) == ("  Hello", [])


# -- the constrained forms: "required" (a JSON array) and a named tool --------------------------------------
ARRAY_CASES: list[tuple[str, str | None, Calls]] = [
    (
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    ('\n[ {"name":"a","arguments":{"x":1}} ]\n', None, [("a", '{"x": 1}')]),
    ('[{"name": "a", "arguments": {}}', None, [("a", "{}")]),  # max_tokens before "]"
    ('[{"name": "a", "arguments": {}}, 5]', ", 5]", [("a", "{}")]),
    ("[]", "[]", []),
    ("plain text", "plain text", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), ARRAY_CASES)
def test_json_array(text: str, content: str | None, calls: Calls) -> None:
    assert extracted(JsonArrayToolParser(), text) == (content, calls)
    assert_stream_agrees(JsonArrayToolParser(), text)


@pytest.mark.parametrize(
    ("text", "arguments"),
    [(' {"city" : "Paris", "days": [1,2]} ', '{"city": "Paris", "days": [1, 2]}'), ("{}", "{}")],
)
def test_named_tool(text: str, arguments: str) -> None:
    parser = NamedToolParser("get_weather")
    assert extracted(parser, text) == (None, [("get_weather", arguments)])
    assert_stream_agrees(parser, text)
    stream = parser.stream()
    first = stream.feed("")
    assert collect(first) == (None, [("get_weather", "")])  # the name goes out before any argument


def test_named_tool_cut_short() -> None:
    assert extracted(NamedToolParser("f"), '{"a": ') == (None, [("f", '{"a":')])  # raw, for the client to see
    assert streamed(NamedToolParser("f"), ['{"a": ']) == (None, [("f", '{"a": ')])
    assert streamed(NamedToolParser("f"), []) == (None, [("f", "")])


# -- choosing the parser ----------------------------------------------------------------------------------
QWEN_TEMPLATE = (
    "{%- if tools %}# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>{%- endif %}'
)
LLAMA_TEMPLATE = (
    "{%- if message.role == 'ipython' or message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>"
    "{%- endif %}{{- '<|python_tag|>' + tool_call.name }}"
)


def test_pick_parser_by_template_and_flag() -> None:
    assert isinstance(pick_parser(QWEN_TEMPLATE), HermesToolParser)
    assert isinstance(pick_parser(LLAMA_TEMPLATE), Llama3JsonToolParser)
    assert isinstance(pick_parser("{{ messages }} ipython"), Llama3JsonToolParser)
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
    assert pick_parser(chatml) is None
    assert pick_parser(None) is None and pick_parser("") is None
    assert isinstance(pick_parser(QWEN_TEMPLATE, "llama3_json"), Llama3JsonToolParser)  # the flag wins
    assert isinstance(pick_parser(None, "Hermes"), HermesToolParser)
    assert isinstance(pick_parser(LLAMA_TEMPLATE, "qwen2_5"), HermesToolParser)
    assert pick_parser(QWEN_TEMPLATE, "none") is None
    with pytest.raises(ConfigError, match="unknown tool-call parser 'mistral'"):
        pick_parser(QWEN_TEMPLATE, "mistral")


def test_the_default_model_speaks_hermes(tokenizer: object) -> None:
    """The bundled model's chat template renders tools and calls in the Hermes form, so "auto" reads them."""
    assert isinstance(pick_parser(tokenizer.chat_template), HermesToolParser)  # type: ignore[attr-defined]
