"""Pydantic models of the OpenAI-compatible answers: completions and chat completions (whole and
streamed), models, vLLM's /tokenize and /detokenize; and, for the OpenAPI schema only, the error, health
and version bodies.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the generated ids (a chunk's new ones)
    prompt_token_ids: list[int] | None = None  # with return_token_ids, in a full response


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallInfo(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it


class ToolCallInfo(BaseModel):
    id: str  # "call_" and 24 letters or digits
    type: Literal["function"] = "function"
    function: FunctionCallInfo


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None  # null when the answer is only tool calls
    tool_calls: list[ToolCallInfo] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatStreamChoice(BaseModel):
    index: int
    # OpenAI's delta: "role" (a choice's first chunk), "content", or "tool_calls": [{"index", "id", "type",
    # "function": {"name", "arguments": ""}}] when a call starts, then [{"index", "function": {"arguments"}}]
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ParallelLayout(BaseModel):
    """How the served model is spread over devices (EngineConfig's fields): each of the
    data_parallel_size replicas runs pipeline_parallel_size stages of tensor_parallel_size ranks."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    distributed_executor_backend: str  # "mp" (worker subprocesses) or "ray" (one Ray actor per rank)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "asyncengine"
    root: str
    # past OpenAI's fields, as vLLM adds max_model_len: what the playground's header shows
    max_model_len: int
    dtype: str  # the weights' dtype as the workers chose it (--dtype, else the checkpoint's)
    parallel: ParallelLayout


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- documentation only: what the schema says the other answers hold ---------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None  # the offending request field, where known
    code: int  # the HTTP status


class ErrorResponse(BaseModel):
    """OpenAI's error object, the body of every 4xx and 5xx answer."""

    error: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok", "degraded", "loading", "shutting_down", "dead"]
    # "degraded" (data-parallel replicas): the indices of the dead replicas; the others serve
    dead_replicas: list[int] | None = None


class VersionResponse(BaseModel):
    version: str


# -- vLLM's /tokenize and /detokenize -------------------------------------------------------------------
class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
