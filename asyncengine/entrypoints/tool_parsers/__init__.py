"""Tool calls in model output (issue 22): parsers from the model's text to OpenAI's tool_calls.

- pick_parser: the model's own call syntax for tool_choice "auto" (hermes for Qwen / Hermes
  templates, llama3_json for Llama 3), from the chat template or an explicit --tool-call-parser flag.
- tool_choice_structured_outputs / tool_choice_parser: "required" and named tools, generated under a
  grammar (asyncengine.structured_output) in one model-independent JSON form, and its parser.

Each parser has extract(text) for a complete output and stream() for a streamed one (feed the text
deltas, then finish()); for well-formed calls they give the same content and calls, the streamed
arguments' fragments adding up to exactly the non-streaming arguments string.
"""

from __future__ import annotations

from asyncengine.entrypoints.tool_parsers.base import ToolParser
from asyncengine.entrypoints.tool_parsers.hermes import HermesToolParser
from asyncengine.entrypoints.tool_parsers.json_array import JsonArrayToolParser
from asyncengine.entrypoints.tool_parsers.llama3 import Llama3JsonToolParser
from asyncengine.entrypoints.tool_parsers.named import NamedToolParser
from asyncengine.entrypoints.tool_parsers.protocol import (
    DeltaMessage,
    ExtractedToolCalls,
    FunctionCall,
    FunctionDelta,
    ToolCall,
    ToolCallDelta,
    make_tool_call_id,
)
from asyncengine.entrypoints.tool_parsers.stream import ToolCallStream
from asyncengine.entrypoints.tool_parsers.tool_choice import (
    required_schema,
    tool_choice_parser,
    tool_choice_structured_outputs,
)
from asyncengine.errors import ConfigError

# flag value -> parser (vLLM's names where it has them: hermes, llama3_json)
PARSERS: dict[str, type[HermesToolParser] | type[Llama3JsonToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "qwen2_5": HermesToolParser,
    "qwen3": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama3": Llama3JsonToolParser,
    "llama": Llama3JsonToolParser,
}
NO_PARSER = ("none", "off")


def pick_parser(chat_template: str | None, flag: str | None = None) -> ToolParser | None:
    """The parser for tool_choice "auto": the flag's if given (ConfigError if unknown; "none" for
    none), else by what the template writes: "<tool_call>" -> hermes, "<|python_tag|>" or the
    "ipython" role -> llama3_json; None when it shows neither (tools then cannot be parsed)."""
    if flag:
        name = flag.strip().lower()
        if name in NO_PARSER:
            return None
        if name not in PARSERS:
            raise ConfigError(
                f"unknown tool-call parser {flag!r}; one of {', '.join([*PARSERS, *NO_PARSER])}"
            )
        return PARSERS[name]()
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HermesToolParser()
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return Llama3JsonToolParser()
    return None


__all__ = [
    "PARSERS",
    "DeltaMessage",
    "ExtractedToolCalls",
    "FunctionCall",
    "FunctionDelta",
    "HermesToolParser",
    "JsonArrayToolParser",
    "Llama3JsonToolParser",
    "NamedToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "make_tool_call_id",
    "pick_parser",
    "required_schema",
    "tool_choice_parser",
    "tool_choice_structured_outputs",
]
