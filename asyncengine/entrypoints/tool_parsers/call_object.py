"""One tool call as a model writes it: {"name": "...", "arguments": {...}} ("parameters" for Llama 3).

`CallReader` reads it one character at a time, reporting the name once it is complete and the
arguments' canonical JSON (json_canon) as it comes; `call_from_value` judges an already-parsed object
the same way, for the non-streaming side. Other members ("type": "function", an "id") are read and
ignored. Arguments may come before the name: they are held until it is known.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from asyncengine.entrypoints.tool_parsers.json_canon import JsonCanonicalizer, JsonSyntaxError, Path, dumps

ARGUMENT_KEYS = ("arguments", "parameters")  # the first present is the arguments; a second is ignored


class CallFormatError(JsonSyntaxError):
    """JSON, but not a call: no name, a name that is not a string, arguments that are not an object."""


def call_from_value(value: Any) -> tuple[str, str] | None:
    """(name, arguments as canonical JSON) of a parsed call object, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in value if k in ARGUMENT_KEYS), None)
    arguments = {} if key is None else value[key]
    if not isinstance(arguments, dict):
        return None
    return value["name"], dumps(arguments)


class CallReader:
    def __init__(self, on_name: Callable[[str], None], on_arguments: Callable[[str], None]) -> None:
        self._on_name = on_name
        self._on_arguments = on_arguments
        self._canon = JsonCanonicalizer(self._text, self._start, self._end)
        self._name_text: list[str] = []
        self._arguments_key: str | None = None
        self.name: str | None = None
        self.done = False

    def feed(self, ch: str) -> None:
        """Reads one character of the call object; JsonSyntaxError (CallFormatError) if it cannot be one.
        Every character up to the closing brace is consumed (an object ends on its own character)."""
        self._canon.feed(ch)

    def _start(self, path: Path, kind: str) -> None:
        if not path:
            if kind != "object":
                raise CallFormatError("a tool call is a JSON object")
        elif len(path) == 1:
            if path[0] == "name" and kind != "string":
                raise CallFormatError("a tool call's name is a string")
            if path[0] in ARGUMENT_KEYS and self._arguments_key is None:
                self._arguments_key = str(path[0])
                if kind != "object":
                    raise CallFormatError(f"a tool call's {path[0]} is a JSON object")

    def _text(self, path: Path, text: str) -> None:
        if not path:
            return
        if path == ("name",):
            self._name_text.append(text)
        elif path[0] == self._arguments_key:
            self._on_arguments(text)

    def _end(self, path: Path) -> None:
        if path == ("name",):
            self.name = json.loads("".join(self._name_text))
            self._on_name(self.name)
        elif not path:
            if self.name is None:
                raise CallFormatError("a tool call has a name")
            if self._arguments_key is None:
                self._on_arguments("{}")
            self.done = True
