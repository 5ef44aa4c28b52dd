"""The output a named tool_choice constrains the model to: that tool's arguments object, nothing else.

    {"city": "Paris"}

The name is the request's, so the stream sends the call's first delta at once, then the arguments as
they come (canonical JSON, like every parser's). Text after the object is dropped. An output that is
not an object (cut short by max_tokens) gives, non-streaming, the raw text as arguments; a stream has
sent what it could read.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncengine.entrypoints.tool_parsers.json_canon import (
    JsonCanonicalizer,
    JsonSyntaxError,
    Path,
    dumps,
    raw_decode,
)
from asyncengine.entrypoints.tool_parsers.protocol import (
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)
from asyncengine.entrypoints.tool_parsers.stream import WHITESPACE, ToolCallStream, skip_ws


class NamedToolParser:
    name = "named"

    def __init__(self, function_name: str, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        self.function_name = function_name
        self._id_factory = id_factory

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            value, _ = raw_decode(text, skip_ws(text, 0))
        except ValueError:
            value = None
        arguments = dumps(value) if isinstance(value, dict) else text.strip(WHITESPACE)
        call = ToolCall(
            id=self._id_factory(), function=FunctionCall(name=self.function_name, arguments=arguments)
        )
        return ExtractedToolCalls(content=None, tool_calls=[call])

    def stream(self) -> NamedToolStream:
        return NamedToolStream(self.function_name, self._id_factory)


class NamedToolStream(ToolCallStream):
    def __init__(self, function_name: str, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        super().__init__(id_factory)
        self._function_name = function_name
        self._canon = JsonCanonicalizer(self._text, self._start)
        self._state = "new"  # new | open (whitespace before "{") | arguments | done

    def _text(self, path: Path, text: str) -> None:
        self._send_arguments(text)

    def _start(self, path: Path, kind: str) -> None:
        if not path and kind != "object":
            raise JsonSyntaxError("the arguments are a JSON object")

    def _feed(self, text: str) -> None:
        if self._state == "new":
            self._on_name(self._function_name)
            self._state = "open"
        for ch in text:
            if self._state == "done":
                return
            if self._state == "open" and ch in WHITESPACE:
                continue
            self._state = "arguments"
            try:
                self._canon.feed(ch)
            except JsonSyntaxError:
                self._state = "done"
            if self._canon.done:
                self._state = "done"

    def _finish(self) -> None:
        if self._state == "new":  # an empty output still names the call
            self._on_name(self._function_name)
