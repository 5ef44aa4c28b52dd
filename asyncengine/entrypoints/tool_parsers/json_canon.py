"""JSON read one character at a time and written back as json.dumps writes it, as far as it is read.

A streamed tool call's arguments go out in fragments whose concatenation must be exactly the string
the non-streaming answer gives, json.dumps(arguments, ensure_ascii=False). That form can be written
while reading: separators ", " and ": ", no other whitespace, string characters as they come (only
'"', '\\' and control characters escaped), a number or literal once it is complete (a number as
json.dumps(json.loads(text)) writes it: "1.50" -> "1.5", "1e2" -> "100.0"). So JsonCanonicalizer
emits canonical text as soon as it is certain, and `loads` below is the strict reading the non-streaming
side uses (no NaN / Infinity, no duplicate keys: a stream cannot take back what it sent for a key that
comes again), so that the two agree on every document both accept.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

Path = tuple[str | int, ...]  # keys and array indices from the top value to where text belongs
NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
NUMBER_CHARS = frozenset("+-.eE0123456789")
WHITESPACE = " \t\n\r"
ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
LITERALS = {"t": "true", "f": "false", "n": "null"}


class JsonSyntaxError(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise JsonSyntaxError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JsonSyntaxError(f"duplicate key {key!r}")
        out[key] = value
    return out


DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)


def raw_decode(text: str, index: int = 0) -> tuple[Any, int]:
    """One JSON value at text[index:] (no leading whitespace) and the index after it, strictly."""
    return DECODER.raw_decode(text, index)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _escape(ch: str) -> str:
    return json.dumps(ch, ensure_ascii=False)[1:-1] if ch in '"\\' or ch < " " else ch


class _Frame:
    __slots__ = ("is_object", "path", "key", "keys", "count")

    def __init__(self, is_object: bool, path: Path) -> None:
        self.is_object = is_object
        self.path = path
        self.key: str | None = None  # the current member's key (objects)
        self.keys: set[str] = set()
        self.count = 0  # members or items so far

    def child(self) -> Path:
        return (*self.path, self.key if self.is_object else self.count)  # type: ignore[arg-type]


class JsonCanonicalizer:
    """Reads one JSON value; calls `on_text(path, text)` with its canonical form as it becomes certain,
    `on_start(path, kind)` when a value begins (kind: object, array, string, number, literal) and
    `on_end(path)` when it is complete. A member key and the ", " / ": " / braces of a container are
    text at the container's path; a value's own text at its path."""

    def __init__(
        self,
        on_text: Callable[[Path, str], None],
        on_start: Callable[[Path, str], None] | None = None,
        on_end: Callable[[Path], None] | None = None,
    ) -> None:
        self._on_text = on_text
        self._on_start = on_start or (lambda path, kind: None)
        self._on_end = on_end or (lambda path: None)
        self._stack: list[_Frame] = []
        self._state = "value"
        self._buf = ""  # number / literal / \u escape being read; a key's decoded characters
        self._high = ""  # a \uD800-\uDBFF escape waiting for its low surrogate
        self._hex = ""  # the digits of a \u escape
        self._is_key = False
        self.done = False

    # -- feeding --------------------------------------------------------------------------------------
    def feed(self, ch: str) -> bool:
        """Reads one character; False if the value ended before it (a number ends at the character
        after it), which then belongs to whatever follows. JsonSyntaxError if it cannot continue."""
        if self.done:
            return False
        state = self._state
        if state == "string":
            self._string_char(ch)
        elif state == "escape":
            self._escape_char(ch)
        elif state == "unicode":
            self._unicode_char(ch)
        elif state in ("number", "literal"):
            return self._scalar_char(ch)
        elif ch in WHITESPACE:
            pass
        elif state == "value":
            self._value(ch)
        elif state == "first_item":  # after '['
            if ch == "]":
                self._close("]")
            else:
                self._value(ch)
        elif state in ("first_key", "key"):  # after '{' / after ',' in an object
            if ch == "}" and state == "first_key":
                self._close("}")
            elif ch == '"':
                self._is_key = True
                self._buf = ""
                self._state = "string"
            else:
                raise JsonSyntaxError(f"expected a key, got {ch!r}")
        elif state == "colon":
            if ch != ":":
                raise JsonSyntaxError(f"expected ':', got {ch!r}")
            self._on_text(self._stack[-1].path, ": ")
            self._state = "value"
        elif state == "after":
            self._after(ch)
        else:  # pragma: no cover
            raise AssertionError(state)
        return True

    def finish(self) -> None:
        """End of input: completes a top-level number or literal; JsonSyntaxError if incomplete."""
        if self.done:
            return
        if not self._stack and self._state in ("number", "literal"):
            self._end_scalar()
        if not self.done:
            raise JsonSyntaxError("incomplete JSON")

    # -- states ---------------------------------------------------------------------------------------
    def _path(self) -> Path:
        return self._stack[-1].child() if self._stack else ()

    def _value(self, ch: str) -> None:
        path = self._path()
        if ch == "{" or ch == "[":
            self._on_start(path, "object" if ch == "{" else "array")
            self._on_text(path, ch)
            self._stack.append(_Frame(ch == "{", path))
            self._state = "first_key" if ch == "{" else "first_item"
        elif ch == '"':
            self._on_start(path, "string")
            self._on_text(path, '"')
            self._is_key = False
            self._state = "string"
        elif ch == "-" or ch.isdigit():
            self._on_start(path, "number")
            self._buf = ch
            self._state = "number"
        elif ch in LITERALS:
            self._on_start(path, "literal")
            self._buf = ch
            self._state = "literal"
        else:
            raise JsonSyntaxError(f"expected a value, got {ch!r}")

    def _after(self, ch: str) -> None:
        frame = self._stack[-1]
        if ch == ",":
            self._on_text(frame.path, ", ")
            self._state = "key" if frame.is_object else "value"
        elif ch == ("}" if frame.is_object else "]"):
            self._close(ch)
        else:
            raise JsonSyntaxError(f"expected ',' or a closing bracket, got {ch!r}")

    def _close(self, ch: str) -> None:
        frame = self._stack.pop()
        self._on_text(frame.path, ch)
        self._value_done(frame.path)

    def _value_done(self, path: Path) -> None:
        self._on_end(path)
        if self._stack:
            self._stack[-1].count += 1
            self._state = "after"
        else:
            self._state = "done"
            self.done = True

    def _put(self, text: str) -> None:
        """Decoded string characters: a key's are kept (it is written whole), a value's written now."""
        if self._high:
            text, self._high = self._high + text, ""
            self._put_now(text[0])
            text = text[1:]
        if text:
            self._put_now(text)

    def _put_now(self, text: str) -> None:
        if self._is_key:
            self._buf += text
        else:
            self._on_text(self._path(), "".join(_escape(c) for c in text))

    def _string_char(self, ch: str) -> None:
        if ch == '"':
            if self._high:
                self._put("")
            self._end_string()
        elif ch == "\\":
            self._state = "escape"
        elif ch < " ":
            raise JsonSyntaxError("control character in a string")
        else:
            self._put(ch)

    def _escape_char(self, ch: str) -> None:
        if ch == "u":
            self._state = "unicode"
            self._hex = ""
            return
        if ch not in ESCAPES:
            raise JsonSyntaxError(f"invalid escape \\{ch}")
        self._state = "string"
        self._put(ESCAPES[ch])

    def _unicode_char(self, ch: str) -> None:
        if ch not in "0123456789abcdefABCDEF":
            raise JsonSyntaxError("invalid \\u escape")
        self._hex += ch
        if len(self._hex) < 4:
            return
        self._state = "string"
        code = int(self._hex, 16)
        if self._high and 0xDC00 <= code <= 0xDFFF:  # the pair json.loads joins into one character
            high, self._high = self._high, ""
            self._put(chr(0x10000 + ((ord(high) - 0xD800) << 10) + (code - 0xDC00)))
        elif 0xD800 <= code <= 0xDBFF:
            if self._high:
                self._put("")
            self._high = chr(code)
        else:
            self._put(chr(code))

    def _end_string(self) -> None:
        if self._is_key:
            frame = self._stack[-1]
            key = self._buf
            if key in frame.keys:
                raise JsonSyntaxError(f"duplicate key {key!r}")
            frame.keys.add(key)
            frame.key = key
            self._on_text(frame.path, dumps(key))
            self._state = "colon"
        else:
            path = self._path()
            self._on_text(path, '"')
            self._value_done(path)

    def _scalar_char(self, ch: str) -> bool:
        if self._state == "number" and ch in NUMBER_CHARS:
            self._buf += ch
            return True
        if self._state == "literal" and ch.isalpha():
            self._buf += ch
            if len(self._buf) > 5:
                raise JsonSyntaxError(f"invalid literal {self._buf!r}")
            return True
        self._end_scalar()
        if self.done:
            return False  # a top-level number: ch is the next thing's
        return self.feed(ch)

    def _end_scalar(self) -> None:
        text = self._buf
        if self._state == "number":
            if not NUMBER.fullmatch(text):
                raise JsonSyntaxError(f"invalid number {text!r}")
            canonical = dumps(json.loads(text))
        else:
            if text != LITERALS[text[0]]:
                raise JsonSyntaxError(f"invalid literal {text!r}")
            canonical = text
        path = self._path()
        self._on_text(path, canonical)
        self._value_done(path)
