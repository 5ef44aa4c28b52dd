"""ToolCallStream: the part of every streaming tool-call parser that is not about the format.

A format's stream (hermes, llama3, ...) reads the model's text deltas and says what is content and
where a call begins; this base turns that into OpenAI's deltas: content text, and per call a first
delta {index, id, type: "function", function: {name, arguments: ""}} once the name is complete, then
argument fragments (canonical JSON, json_canon), merged per feed.

Content is the text outside the calls, with the whitespace that only separates it from a call dropped
(the "\n" between "</tool_call>" and "<tool_call>", the one before the first call): trailing
whitespace is held until the next thing is known. A call that turns out malformed before its name was
sent becomes content, as the non-streaming extract() makes it; one that breaks after (its arguments cut
off by max_tokens, invalid JSON) cannot be taken back and stays as far as it was sent.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncengine.entrypoints.tool_parsers.call_object import CallReader
from asyncengine.entrypoints.tool_parsers.json_canon import JsonSyntaxError
from asyncengine.entrypoints.tool_parsers.protocol import (
    DeltaMessage,
    FunctionDelta,
    ToolCallDelta,
    make_tool_call_id,
)

WHITESPACE = " \t\n\r"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that `tag` starts with (a tag that may be arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


class ToolCallStream:
    def __init__(self, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        self._id_factory = id_factory
        self._out: list[DeltaMessage] = []
        self._index = -1  # the last call's index
        self._ws = ""  # content's trailing whitespace, not sent until known not to precede a call
        self._after_call = False  # content since the last call has been whitespace only
        self._reader: CallReader | None = None
        self._call_ws = ""  # whitespace held before the current call (content again if it fails)
        self._call_raw: list[str] = []  # the current call's text, for content if it fails unnamed
        self._named = False  # the current call's first delta was sent
        self._early_arguments: list[str] = []  # arguments read before the name
        self.finished = False

    # -- the public side --------------------------------------------------------------------------------
    def feed(self, text: str) -> list[DeltaMessage]:
        """Reads the next piece of the model's text; returns the deltas it completes (maybe none)."""
        if self.finished:
            raise RuntimeError("feed() after finish()")
        self._feed(text)
        return self._take()

    def finish(self) -> list[DeltaMessage]:
        """The end of the text: sends what was held back (content that might have been a tag)."""
        if not self.finished:
            self.finished = True
            self._finish()
            if self._reader is not None:
                self._abandon_call()
            if self._ws:
                self._send_content(self._ws)
                self._ws = ""
        return self._take()

    @property
    def num_calls(self) -> int:
        return self._index + 1

    # -- what a format calls ------------------------------------------------------------------------------
    def _feed(self, text: str) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        """End of text in the format's state; an unfinished call is handled after it."""

    def _content(self, text: str) -> None:
        """Text outside the calls."""
        if self._after_call:
            text = text.lstrip(WHITESPACE)
            if not text:
                return
            self._after_call = False
        body = text.rstrip(WHITESPACE)
        if body:
            self._send_content(self._ws + body)
            self._ws = text[len(body) :]
        else:
            self._ws += text

    def _begin_call(self, raw: str = "") -> None:
        """A call starts; `raw` is the format's text so far that belongs to it (a tag, a separator)."""
        self._call_ws, self._ws = self._ws, ""
        self._call_raw = [raw]
        self._named = False
        self._early_arguments = []
        self._reader = CallReader(self._on_name, self._on_arguments)

    def _call_text(self, text: str) -> None:
        """Text that belongs to the current call but not to its JSON (whitespace before the brace)."""
        self._call_raw.append(text)

    def _open_char(self, ch: str) -> str | None:
        """One character after a call began but before its object's "{": whitespace stays with the call
        (None: still open), "{" starts the object (_call_char's status), anything else abandons the call,
        whose text becomes content ("failed")."""
        if ch in WHITESPACE:
            self._call_text(ch)
            return None
        if ch == "{":
            return self._call_char(ch)
        self._call_text(ch)
        return self._abandon_call()

    def _call_char(self, ch: str) -> str:
        """Feeds one character of the call object: "more", "done", "failed" (malformed before its name:
        its text became content) or "broken" (malformed after the name: the call stands as sent)."""
        assert self._reader is not None
        self._call_raw.append(ch)
        try:
            self._reader.feed(ch)
        except JsonSyntaxError:
            return self._abandon_call()
        if self._reader.done:
            self._end_call()
            return "done"
        return "more"

    def _abandon_call(self) -> str:
        named = self._named
        self._reader = None
        if named:
            self._after_call = True
            return "broken"
        self._content(self._call_ws + "".join(self._call_raw))
        return "failed"

    # -- deltas ---------------------------------------------------------------------------------------
    def _end_call(self) -> None:
        self._reader = None
        self._after_call = True

    def _on_name(self, name: str) -> None:
        self._named = True  # the whitespace held before the call is dropped: it only separated
        self._index += 1
        delta = ToolCallDelta(
            index=self._index,
            id=self._id_factory(),
            type="function",
            function=FunctionDelta(name=name, arguments=""),
        )
        self._out.append(DeltaMessage(tool_calls=[delta]))
        if self._early_arguments:
            self._send_arguments("".join(self._early_arguments))

    def _on_arguments(self, text: str) -> None:
        if self._named:
            self._send_arguments(text)
        else:
            self._early_arguments.append(text)

    def _send_arguments(self, text: str) -> None:
        last = self._out[-1].tool_calls if self._out else None
        if last and last[0].id is None and last[0].index == self._index:
            last[0].function.arguments = (last[0].function.arguments or "") + text
        else:
            delta = ToolCallDelta(index=self._index, function=FunctionDelta(arguments=text))
            self._out.append(DeltaMessage(tool_calls=[delta]))

    def _send_content(self, text: str) -> None:
        if self._out and self._out[-1].content is not None:
            self._out[-1].content += text
        else:
            self._out.append(DeltaMessage(content=text))

    def _take(self) -> list[DeltaMessage]:
        out, self._out = self._out, []
        return out
