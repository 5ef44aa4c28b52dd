"""What tool-call parsing produces, shaped as OpenAI's chat API sends it (msgspec Structs: they are
encoded straight into responses and stream chunks)."""

from __future__ import annotations

import secrets
import string

import msgspec

_ID_CHARS = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """OpenAI's form: "call_" and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # the arguments object as JSON text: json.dumps(arguments, ensure_ascii=False)


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ExtractedToolCalls(msgspec.Struct):
    content: str | None  # the text outside the calls; None when there is none
    tool_calls: list[ToolCall]


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A call's first delta has id, type, function.name and function.arguments ""; the later ones only
    index and an arguments fragment."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    """One piece of a streamed answer: content text, or one call's delta (never both)."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
