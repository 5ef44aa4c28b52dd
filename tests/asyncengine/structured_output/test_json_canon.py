"""JsonCanonicalizer writes, character by character, exactly json.dumps(json.loads(text),
ensure_ascii=False), for any formatting of any document; and refuses what the strict loads refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.entrypoints.tool_parsers.json_canon import (
    JsonCanonicalizer,
    JsonSyntaxError,
    Path,
    dumps,
    raw_decode,
)


def canonical(text: str) -> tuple[str, str]:
    """(canonical text, what was left after the value) fed one character at a time."""
    out: list[str] = []
    canon = JsonCanonicalizer(lambda path, piece: out.append(piece))
    for i, ch in enumerate(text):
        if not canon.feed(ch):
            return "".join(out), text[i:]
    canon.finish()
    return "".join(out), ""


DOCUMENTS = [
    '{"a": 1, "b": [1, 2.50, -0, -0.0, 1e2, 1E-3, 12345678901234567890, true, false, null]}',
    '{"s": "x\\ny\\t\\u00e9\\ud83d\\ude00\\"\\\\\\/\\b\\f\\r\\u0001\\u001f"}',
    '{"lone high": "\\ud83d", "lone low": "\\ude00", "high then text": "\\ud83dA"}',
    '{"two highs": "\\ud83d\\ud83d", "high at the end": "a\\ud83d"}',
    '{"nested": {"deeper": {"deepest": [[], {}, [{}], ""]}}}',
    ' \n\t[ 1 , { "x" : -1.5E-3 } ]\r\n',
    '"just a string"',
    "-12.5e+3",
    "null",
    '{"ünïcødé": "日本語", "emoji": "🎉"}',
    '{"html": "</tool_call><tool_call>{\\"name\\": 1}"}',
]


@pytest.mark.parametrize("text", DOCUMENTS)
def test_documents(text: str) -> None:
    got, rest = canonical(text)
    assert got == dumps(json.loads(text))
    assert rest.strip() == ""


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values, indent=st.sampled_from([None, 0, 2]), ascii=st.booleans(), compact=st.booleans())
def test_any_document_any_formatting(value: Any, indent: int | None, ascii: bool, compact: bool) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=ascii, separators=(",", ":") if compact else None)
    got, rest = canonical(text)
    assert got == dumps(value)
    assert rest == ""


def test_a_value_ends_where_it_ends() -> None:
    assert canonical('{"a": 1} tail') == ('{"a": 1}', " tail")
    assert canonical("12;") == ("12", ";")  # a number ends at the character after it, left unread
    assert canonical('"s",') == ('"s"', ",")


INVALID = [
    '{"a": 1, "a": 2}', '{"a": NaN}', "[Infinity]", "[1,]", '{"a" 1}', '"a\nb"', "01", "tru", "[1 2]",
    '{"a":1,}', '"\\x"', '"\\u12G4"', "{", '["open"', "-", "1.", "1e", "[-]",
]  # fmt: skip


@pytest.mark.parametrize("text", INVALID)
def test_invalid_json_is_refused(text: str) -> None:
    """Both readings refuse it, as an argument value (at the top a number may be followed by anything:
    "01" is 0 and then "1", which the caller judges)."""
    inside = '{"k": ' + text + "}"
    with pytest.raises(JsonSyntaxError):
        canonical(inside)
    with pytest.raises(ValueError):
        raw_decode(inside)


def test_paths_route_the_text() -> None:
    pieces: list[tuple[Path, str]] = []
    starts: list[tuple[Path, str]] = []
    ends: list[Path] = []
    canon = JsonCanonicalizer(
        lambda p, t: pieces.append((p, t)), lambda p, k: starts.append((p, k)), ends.append
    )
    for ch in '{"name": "f", "arguments": {"x": [1, "y"]}}':
        canon.feed(ch)
    assert canon.done
    by_path: dict[Path, str] = {}
    for path, text in pieces:
        by_path[path] = by_path.get(path, "") + text
    assert by_path[()] == '{"name": , "arguments": }'
    assert by_path[("name",)] == '"f"'
    assert by_path[("arguments",)] == '{"x": }'
    assert by_path[("arguments", "x")] == "[, ]"
    assert by_path[("arguments", "x", 0)] == "1" and by_path[("arguments", "x", 1)] == '"y"'
    assert starts[:3] == [((), "object"), (("name",), "string"), (("arguments",), "object")]
    assert ends[-2:] == [("arguments",), ()]
