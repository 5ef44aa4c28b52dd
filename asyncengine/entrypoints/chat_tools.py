"""How a chat completion's tool calls are read out of its text: which parser, and what the answer then says.

- tool_choice "required" or a named tool: the output was generated under the tool-choice grammar, in
  the one JSON form its parser reads (JsonArrayToolParser / NamedToolParser); the answer is only calls.
- "auto": the model's own call syntax, read by the parser the chat template implies or --tool-call-parser
  names (pick_parser); text and calls are separated. A template that shows no known syntax, or the flag
  "none", leaves the text as it is: a model that cannot be parsed still answers.
- "none", or no tools: plain text, no parser.

A finished choice with calls ends with finish_reason "tool_calls" (OpenAI's) where the model stopped by
itself ("stop"); "length" and "abort" stay, so a client sees a call that may be cut short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from asyncengine.entrypoints.chat_protocol import ChatToolFields
from asyncengine.entrypoints.openai_responses import ChatResponseMessage, ToolCallInfo
from asyncengine.entrypoints.tool_parsers import (
    DeltaMessage,
    ToolCallStream,
    ToolParser,
    pick_parser,
    tool_choice_parser,
)

AUTO = "auto"  # --tool-call-parser's default: the parser the chat template implies


@dataclass(frozen=True)
class ToolCalling:
    parser: ToolParser
    forced: bool  # "required" / named: the text is the calls alone, never content

    def message(self, text: str) -> tuple[ChatResponseMessage, bool]:
        """A whole output's message, and whether it holds calls."""
        found = self.parser.extract(text)
        if not found.tool_calls:
            return ChatResponseMessage(content=text), False
        calls = [ToolCallInfo.model_validate(msgspec.to_builtins(c)) for c in found.tool_calls]
        return ChatResponseMessage(content=None if self.forced else found.content, tool_calls=calls), True

    def stream(self) -> ToolCallStream:
        return self.parser.stream()


def tool_calling(req: ChatToolFields, chat_template: str | None, flag: str | None) -> ToolCalling | None:
    """The request's tool-call reading; None for plain text. `flag` is --tool-call-parser (None or "auto":
    by the chat template). Call after req.sampling_params(), which has checked tools and tool_choice."""
    choice = req.effective_tool_choice
    if choice == "none" or not req.tools:
        return None
    forced = tool_choice_parser(choice)
    if forced is not None:
        return ToolCalling(forced, True)
    parser = pick_parser(chat_template, None if flag in (None, AUTO) else flag)
    return None if parser is None else ToolCalling(parser, False)


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def delta_dicts(deltas: list[DeltaMessage]) -> list[dict[str, Any]]:
    """The parser's deltas as OpenAI's chunk deltas: {"content": ...} or {"tool_calls": [...]}."""
    return [msgspec.to_builtins(d) for d in deltas]
