"""Pydantic models of OpenAI's chat `tools` (function definitions), as requests send them.

Only function tools exist here: the other kinds OpenAI defines ("custom" tools with free-form or grammar
input) are a 400 naming `tools`. A definition reaches the chat template as the client wrote it (minus
nulls), wrapped as transformers wraps a dict tool: {"type": "function", "function": {...}}.
"""

from __future__ import annotations

from typing import Any

from asyncengine.entrypoints.api_errors import ApiError
from asyncengine.entrypoints.request_model import RequestModel


class ToolFunction(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; none: no arguments
    # OpenAI's "follow the schema exactly": "required" and named tool_choice always do here (a grammar);
    # "auto" never can (nothing is forced), so it is accepted and changes nothing
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: str = "function"
    function: ToolFunction | None = None
    custom: dict[str, Any] | None = None  # OpenAI's custom tools: refused by check()

    def check(self, index: int) -> None:
        if self.type != "function" or self.function is None or self.custom is not None:
            raise ApiError(
                f'tools[{index}]: only function tools are supported ({{"type": "function", "function": '
                f'{{"name": ...}}}}), got type {self.type!r}',
                param="tools",
            )
        if not self.function.name:
            raise ApiError(f"tools[{index}].function.name must not be empty", param="tools")

    def as_dict(self) -> dict[str, Any]:
        """The definition as OpenAI's JSON (and transformers' dict tools) spell it, without nulls."""
        assert self.function is not None  # check() passed
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


def tool_dicts(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """The checked definitions as dicts (what the template and the tool-choice constraint take); None for
    no tools (an empty list included: OpenAI treats it as none)."""
    if not tools:
        return None
    for i, tool in enumerate(tools):
        tool.check(i)
    return [tool.as_dict() for tool in tools]
