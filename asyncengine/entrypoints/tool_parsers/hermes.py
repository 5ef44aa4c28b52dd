"""Hermes / Qwen2.5 / Qwen3 tool calls: each call a JSON object between <tool_call> tags.

    I'll look both up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Rome"}}
    </tool_call>

A <tool_call> whose body is not such an object is plain text (the tag included); a missing
</tool_call> at the end of the output is forgiven (the model stopped right after the object); text
between the object and </tool_call> is dropped. The object is read as JSON, so a "</tool_call>" inside
an argument string does not end the call.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncengine.entrypoints.tool_parsers.base import ExtractedBuilder
from asyncengine.entrypoints.tool_parsers.call_object import call_from_value
from asyncengine.entrypoints.tool_parsers.json_canon import raw_decode
from asyncengine.entrypoints.tool_parsers.protocol import ExtractedToolCalls, make_tool_call_id
from asyncengine.entrypoints.tool_parsers.stream import WHITESPACE, ToolCallStream, partial_suffix, skip_ws

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser:
    name = "hermes"

    def __init__(self, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        self._id_factory = id_factory

    def extract(self, text: str) -> ExtractedToolCalls:
        out = ExtractedBuilder(self._id_factory)
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                out.text(text[pos:])
                return out.result()
            out.text(text[pos:start])
            body = skip_ws(text, start + len(START))
            try:
                value, end = raw_decode(text, body)
                call = call_from_value(value)
            except ValueError:
                call = None
            if call is None:  # not a call: the tag is text, and the search goes on after it
                out.text(START)
                pos = start + len(START)
                continue
            out.call(*call)
            after = skip_ws(text, end)
            if text.startswith(END, after):
                pos = after + len(END)
            elif text.startswith(START, after):
                pos = after
            else:  # text after the object: dropped up to the end tag
                close = text.find(END, after)
                pos = len(text) if close < 0 else close + len(END)

    def stream(self) -> HermesStream:
        return HermesStream(self._id_factory)


class HermesStream(ToolCallStream):
    def __init__(self, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        super().__init__(id_factory)
        self._state = "content"  # content | open (after <tool_call>) | call | close (after the object) | drop
        self._buf = ""

    def _feed(self, text: str) -> None:
        buf = self._buf + text
        i = 0
        while i < len(buf):
            state = self._state
            if state == "content":
                start = buf.find(START, i)
                if start < 0:
                    keep = partial_suffix(buf, START)
                    self._content(buf[i : len(buf) - keep])
                    i = len(buf) - keep
                    break
                self._content(buf[i:start])
                i = start + len(START)
                self._begin_call(START)
                self._state = "open"
            elif state == "open":
                ch = buf[i]
                i += 1
                if ch in WHITESPACE:
                    self._call_text(ch)
                    continue
                self._after_char(self._call_char(ch))
            elif state == "call":
                ch = buf[i]
                i += 1
                self._after_char(self._call_char(ch))
            elif state == "close":
                i = skip_ws(buf, i)
                rest = buf[i:]
                if rest.startswith(END):
                    i += len(END)
                    self._state = "content"
                elif rest.startswith(START):
                    i += len(START)
                    self._begin_call(START)
                    self._state = "open"
                elif END.startswith(rest) or START.startswith(rest):
                    break  # a tag may be arriving
                else:
                    self._state = "drop"
            else:  # drop
                close = buf.find(END, i)
                if close < 0:
                    i = len(buf) - partial_suffix(buf, END)
                    break
                i = close + len(END)
                self._state = "content"
        self._buf = buf[i:]

    def _after_char(self, status: str) -> None:
        self._state = {"more": "call", "done": "close", "failed": "content", "broken": "drop"}[status]

    def _finish(self) -> None:
        if self._state == "content":
            self._content(self._buf)  # a partial "<tool_c" at the very end is text
        self._buf = ""
