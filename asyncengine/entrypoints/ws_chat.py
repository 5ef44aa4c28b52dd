"""The websocket's chat frames: their messages and tools, checked strictly, and tool calls in the frames
a chat with tools streams back.

A chat frame carries `messages` (role and content; an assistant's earlier `tool_calls`, with content
null, and a `tool` message's `tool_call_id` as the chat route takes them), optionally
`add_generation_prompt`, `tools`, `tool_choice` and `parallel_tool_calls` (as the chat route's).

With tools, a delta frame's `text` is the content alone (the text outside any call) and its
`tool_calls` the call deltas as OpenAI streams them: a call's first {"index", "id", "type": "function",
"function": {"name", "arguments": ""}}, then {"index", "function": {"arguments": "..."}} fragments. The
done frame then has the complete `tool_calls` (each {"id", "type", "function": {"name", "arguments"}},
the arguments a JSON string) and finish_reason "tool_calls" when the model stopped after calling.
"""

from __future__ import annotations

from typing import Any

import pydantic

from asyncengine.entrypoints.api_errors import ApiError
from asyncengine.entrypoints.chat_protocol import ChatMessage, ChatToolFields
from asyncengine.entrypoints.chat_tools import ToolCalling, delta_dicts, finish_reason
from asyncengine.entrypoints.request_model import validation_error

MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # go with messages only
CHAT_FIELDS = ("add_generation_prompt", *TOOL_FIELDS)


def parse_chat(frame: dict[str, Any]) -> ChatToolFields:
    """The chat of a frame with `messages`; a 400 naming the field for anything malformed."""
    messages = parse_messages(frame["messages"])
    add_generation_prompt = frame.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise ApiError("add_generation_prompt must be true or false", param="add_generation_prompt")
    try:
        return ChatToolFields(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{k: frame[k] for k in TOOL_FIELDS if k in frame},
        )
    except pydantic.ValidationError as e:
        raise validation_error(e, ChatToolFields) from None


def parse_messages(messages: Any) -> list[ChatMessage]:
    """A non-empty list of {"role": str, "content": str} objects, which may add a `name`, an assistant's
    `tool_calls` (a list of objects; content may then be null) and a tool message's `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise ApiError('messages must be a non-empty list of {"role", "content"} objects', param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not set(m) <= MESSAGE_FIELDS:
            raise ApiError(
                f"messages[{i}] must be an object with the fields role and content (and optionally "
                "name, tool_calls, tool_call_id)",
                param="messages",
            )
        if not isinstance(m["role"], str) or not m["role"]:
            raise ApiError(f"messages[{i}].role must be a non-empty string", param="messages")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ApiError(f"messages[{i}].content must be a string", param="messages")
        for key in ("name", "tool_call_id"):
            if key in m and not isinstance(m[key], str):
                raise ApiError(f"messages[{i}].{key} must be a string", param="messages")
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise ApiError(f"messages[{i}].tool_calls must be a list of objects", param="messages")
        out.append(ChatMessage(**m))
    return out


class ToolCallFrames:
    """One streamed chat's tool calls: the frames' fields for each output, and the calls so far."""

    def __init__(self, tools: ToolCalling) -> None:
        self._stream = tools.stream()
        self.calls: list[dict[str, Any]] = []  # complete as far as streamed: OpenAI's tool_calls

    def fields(self, text: str, finished: bool) -> dict[str, Any]:
        """A delta frame's `text` (content only) and `tool_calls` (if any) for the output's new text."""
        deltas = self._stream.feed(text) if text else []
        if finished:
            deltas += self._stream.finish()
        content: list[str] = []
        call_deltas: list[dict[str, Any]] = []
        for delta in delta_dicts(deltas):
            if "content" in delta:
                content.append(delta["content"])
            for call in delta.get("tool_calls", ()):
                call_deltas.append(call)
                self._accumulate(call)
        out: dict[str, Any] = {"text": "".join(content)}
        if call_deltas:
            out["tool_calls"] = call_deltas
        return out

    def _accumulate(self, delta: dict[str, Any]) -> None:
        function = delta["function"]
        if "id" in delta:  # a call's first delta
            self.calls.append(
                {
                    "id": delta["id"],
                    "type": "function",
                    "function": {"name": function["name"], "arguments": function.get("arguments", "")},
                }
            )
        else:
            self.calls[delta["index"]]["function"]["arguments"] += function.get("arguments", "")

    def finish_reason(self, reason: str) -> str:
        return finish_reason(reason, bool(self.calls)) or reason
