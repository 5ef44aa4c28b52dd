"""Llama 3.x JSON tool calls: the whole output is calls, optionally after <|python_tag|>, ";"-separated.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}

An output whose first non-space text is neither "{" nor <|python_tag|> is content, all of it (Llama's
templates put calls first). A call that is not {"name": str, "parameters" | "arguments": object}
makes it and everything after it content: the whole output if it is the first call. A trailing ";"
is dropped, other text after the last call is content. <|python_tag|> is a special token: decode with
skip_special_tokens=False to see it (without it, calls are still found from the "{").
"""

from __future__ import annotations

from collections.abc import Callable

from asyncengine.entrypoints.tool_parsers.base import ExtractedBuilder
from asyncengine.entrypoints.tool_parsers.call_object import call_from_value
from asyncengine.entrypoints.tool_parsers.json_canon import raw_decode
from asyncengine.entrypoints.tool_parsers.protocol import ExtractedToolCalls, make_tool_call_id
from asyncengine.entrypoints.tool_parsers.stream import WHITESPACE, ToolCallStream, skip_ws

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonToolParser:
    name = "llama3_json"

    def __init__(self, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        self._id_factory = id_factory

    def extract(self, text: str) -> ExtractedToolCalls:
        out = ExtractedBuilder(self._id_factory)
        first = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, first):
            pos = skip_ws(text, first + len(PYTHON_TAG))
        elif text.startswith("{", first):
            pos = first
        else:
            out.text(text)
            return out.result()
        failed_from = 0  # where content starts if the next call is not one: all of it for the first
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
            if after == len(text):
                return out.result()
            if text[after] != SEPARATOR:
                out.text(text[after:])
                return out.result()
            failed_from = after
            pos = skip_ws(text, after + 1)
            if pos == len(text):  # a trailing ";"
                return out.result()

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self._id_factory)


class Llama3JsonStream(ToolCallStream):
    def __init__(self, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        super().__init__(id_factory)
        # start | open (after the tag / a ";": before "{") | call | between (after a call) | content | drop
        self._state = "start"
        self._buf = ""  # the undecided start of the output
        self._separator = ""  # ";" and the whitespace after it, for content if no call follows

    def _feed(self, text: str) -> None:
        i = 0
        if self._state == "start":
            buf, self._buf = self._buf + text, ""
            text = self._decide(buf)
            if self._state == "start":
                return
        while i < len(text):
            state = self._state
            if state == "content":
                self._content(text[i:])
                return
            if state == "drop":
                return
            ch = text[i]
            i += 1
            if state == "open":
                status = self._open_char(ch)
                if status is not None:
                    self._after_char(status)
            elif state == "call":
                self._after_char(self._call_char(ch))
            elif state == "between":
                if ch in WHITESPACE:
                    continue
                if ch == SEPARATOR:
                    self._begin_call(SEPARATOR)
                    self._state = "open"
                else:
                    self._state = "content"
                    i -= 1

    def _decide(self, buf: str) -> str:
        """Calls or content, once the output's start shows; returns the text left to read."""
        first = skip_ws(buf, 0)
        rest = buf[first:]
        if not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG):
            self._buf = buf
            return ""
        if rest.startswith(PYTHON_TAG):
            self._begin_call(buf[: first + len(PYTHON_TAG)])
            self._state = "open"
            return buf[first + len(PYTHON_TAG) :]
        if rest.startswith("{"):
            self._begin_call(buf[:first])
            self._state = "open"
            return rest
        self._state = "content"
        return buf

    def _after_char(self, status: str) -> None:
        self._state = {"more": "call", "done": "between", "failed": "content", "broken": "drop"}[status]

    def _finish(self) -> None:
        if self._state == "start":
            self._content(self._buf)
        elif self._state == "open" and self.num_calls and "".join(self._call_raw).strip() == SEPARATOR:
            self._reader = None  # a trailing ";": dropped, not content
