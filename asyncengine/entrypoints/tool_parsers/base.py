"""What every tool-call parser offers, and the non-streaming side's bookkeeping of content."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from asyncengine.entrypoints.tool_parsers.protocol import ExtractedToolCalls, FunctionCall, ToolCall
from asyncengine.entrypoints.tool_parsers.stream import WHITESPACE, ToolCallStream


class ToolParser(Protocol):
    name: str

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a complete model output, and the content around them."""
        ...

    def stream(self) -> ToolCallStream:
        """A parser for one streamed output: feed() it the text deltas, then finish()."""
        ...


class ExtractedBuilder:
    """Content and calls in the order found; content follows the streams' whitespace rule (whitespace
    next to a call is dropped), so that extract() and a stream agree."""

    def __init__(self, id_factory: Callable[[], str]) -> None:
        self._id_factory = id_factory
        self._parts: list[str] = []
        self._segment: list[str] = []
        self._after_call = False
        self.calls: list[ToolCall] = []

    def text(self, text: str) -> None:
        self._segment.append(text)

    def call(self, name: str, arguments: str) -> None:
        segment = "".join(self._segment)
        if self._after_call:
            segment = segment.lstrip(WHITESPACE)
        self._parts.append(segment.rstrip(WHITESPACE))
        self._segment = []
        self._after_call = True
        self.calls.append(
            ToolCall(id=self._id_factory(), function=FunctionCall(name=name, arguments=arguments))
        )

    def result(self) -> ExtractedToolCalls:
        segment = "".join(self._segment)
        if self._after_call:
            segment = segment.lstrip(WHITESPACE)
        content = "".join(self._parts) + segment
        return ExtractedToolCalls(content=content or None, tool_calls=self.calls)
