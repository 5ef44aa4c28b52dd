"""The output tool_choice="required" constrains the model to: a JSON array of calls (tool_choice.py).

    [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

The grammar makes it well-formed; only max_tokens can cut it short. Read like Llama 3's format: an
output not starting with "[" (after whitespace) is content; an element that is not a call makes it and
everything after it content (the whole output for the first); text after "]" is content.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncengine.entrypoints.tool_parsers.base import ExtractedBuilder
from asyncengine.entrypoints.tool_parsers.call_object import call_from_value
from asyncengine.entrypoints.tool_parsers.json_canon import raw_decode
from asyncengine.entrypoints.tool_parsers.protocol import ExtractedToolCalls, make_tool_call_id
from asyncengine.entrypoints.tool_parsers.stream import WHITESPACE, ToolCallStream, skip_ws


class JsonArrayToolParser:
    name = "json_array"

    def __init__(self, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        self._id_factory = id_factory

    def extract(self, text: str) -> ExtractedToolCalls:
        out = ExtractedBuilder(self._id_factory)
        first = skip_ws(text, 0)
        if not text.startswith("[", first):
            out.text(text)
            return out.result()
        failed_from = 0
        pos = skip_ws(text, first + 1)
        while True:
            try:
                value, end = raw_decode(text, pos)
                call = call_from_value(value)
            except ValueError:
                call = None
            if call is None:
                out.text(text[failed_from:])
                return out.result()
            out.call(*call)
            after = skip_ws(text, end)
            if text.startswith("]", after):
                out.text(text[after + 1 :])
                return out.result()
            if not text.startswith(",", after):
                out.text(text[after:])
                return out.result()
            failed_from = after
            pos = skip_ws(text, after + 1)

    def stream(self) -> JsonArrayStream:
        return JsonArrayStream(self._id_factory)


class JsonArrayStream(ToolCallStream):
    def __init__(self, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        super().__init__(id_factory)
        self._state = "start"  # start | open (before an element's "{") | call | between | content | drop
        self._lead = ""  # whitespace before "["

    def _feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            state = self._state
            if state == "content":
                self._content(text[i:])
                return
            if state == "drop":
                return
            ch = text[i]
            i += 1
            if state == "start":
                if ch in WHITESPACE:
                    self._lead += ch
                elif ch == "[":
                    self._begin_call(self._lead + ch)
                    self._state = "open"
                else:
                    self._content(self._lead)
                    self._state = "content"
                    i -= 1
            elif state == "open":
                status = self._open_char(ch)
                if status is not None:
                    self._after_char(status)
            elif state == "call":
                self._after_char(self._call_char(ch))
            elif state == "between":
                if ch in WHITESPACE:
                    continue
                if ch == ",":
                    self._begin_call(ch)
                    self._state = "open"
                elif ch == "]":
                    self._state = "content"  # what follows the array
                else:
                    self._state = "content"
                    i -= 1

    def _after_char(self, status: str) -> None:
        self._state = {"more": "call", "done": "between", "failed": "content", "broken": "drop"}[status]

    def _finish(self) -> None:
        if self._state == "start":
            self._content(self._lead)
