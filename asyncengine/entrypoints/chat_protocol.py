"""Pydantic models of a chat: its messages (text, content parts, an assistant's tool calls, tool results)
and the chat-template fields a request may set (tools among them), shared by /v1/chat/completions,
/tokenize and the websocket's chat frames. Rendered by entrypoints/prompts.py."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from asyncengine.entrypoints.api_errors import ApiError
from asyncengine.entrypoints.request_model import RequestModel
from asyncengine.entrypoints.tool_parsers import tool_choice_structured_outputs
from asyncengine.entrypoints.tool_protocol import ToolDefinition, tool_dicts
from asyncengine.structured_output import StructuredOutputsParams


class ContentPart(RequestModel):
    """One part of a message's content; only text parts are supported, the others are a 400."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None
    refusal: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a prompt-caching hint: ignored


class ChatMessage(RequestModel):
    """A message of any of OpenAI's roles (system, developer, user, assistant, tool, function)."""

    NEUTRAL = {"function_call": (None,), "audio": (None,)}

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls: passed to the template
    tool_call_id: str | None = None  # what a tool message answers: passed to the template
    refusal: str | None = None  # an assistant's earlier refusal: its content when it has none
    annotations: list[Any] | None = None  # of an earlier response (URL citations): ignored
    function_call: dict[str, Any] | None = None  # deprecated function calling: refused unless null
    audio: dict[str, Any] | None = None  # an earlier audio response: refused unless null

    def as_template_input(self) -> dict[str, Any]:
        try:
            self.check_neutral()
        except ApiError as e:
            raise ApiError(f"messages: {e}", param="messages") from None
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise ApiError("only text content parts are supported", param="messages")
            content = "".join(part.text or "" for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or self.refusal or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
        return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends a call's arguments as a JSON string; chat templates expect the object (as vLLM does)."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        except ValueError:
            pass
    return call


def template_chars(messages: list[dict[str, Any]]) -> int:
    """About how many characters the messages put into the template (what bounds its cost)."""
    return sum(
        len(m["content"]) + (len(json.dumps(m["tool_calls"])) if "tool_calls" in m else 0) for m in messages
    )


class ChatTemplateFields(RequestModel):
    """How messages become a prompt (vLLM's fields; chat and /tokenize share them)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes BOS itself
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)
    chat_template: str | None = None  # a request's own template: refused unless null
    documents: list[dict[str, Any]] | None = None  # RAG documents for the template: refused unless null
    tools: list[ToolDefinition] | None = None  # function definitions, passed to the template

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` the template gets (transformers' dict form), or None."""
        return tool_dicts(self.tools)

    def template_kwargs(self) -> dict[str, Any]:
        """The template's extra variables; never one that would steer apply_chat_template itself."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_ARGS & kwargs.keys())
        if reserved:
            raise ApiError(
                f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
            )
        return kwargs


class ChatToolFields(ChatTemplateFields):
    """Tool calling (the chat route's and the websocket's chat frames'): which tool the model may or must
    call; "required" and a named tool constrain the output (tool_choice_structured_outputs)."""

    tool_choice: str | dict[str, Any] | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # "required": one call or several (default: several)

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        tools = super().template_tools()
        # NOTE: "none" promises a plain answer: a template shown the tools invites a call, which would
        # then be text; tools=None renders the chat as without tools (the history's calls still show)
        return None if self.effective_tool_choice == "none" else tools

    def tool_structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of "required" or a named tool (None for "none" / "auto"); a 400 naming the field
        for an unknown tool, a named or "required" choice without tools, or a schema that does not compile."""
        tools = tool_dicts(self.tools)
        choice = self.effective_tool_choice
        if tools is None and choice not in ("none", "auto"):
            raise ApiError("tool_choice needs tools", param="tool_choice")
        return tool_choice_structured_outputs(tools, choice, self.parallel_tool_calls)


# apply_chat_template's own arguments (and the message list): not template variables a request may set
RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
