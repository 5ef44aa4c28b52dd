"""Pydantic models of OpenAI's /v1/completions and /v1/chat/completions, plus vLLM's sampling extras.

Unknown fields are ignored (as vLLM does); features we do not implement are rejected with a 400
instead of being silently dropped. Types are strict, as OpenAI's are: `"4"`, `true` and `2.0` are no
integers (an integer passes as a float); ranges are SamplingParams' own checks, which name the field.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from asyncengine.entrypoints.api_errors import ApiError
from asyncengine.sampling_params import OutputKind, SamplingParams, SamplingParamsError

MAX_PROMPTS = 256  # prompts in one batched /v1/completions request


STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model_config = STRICT

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError("stream_options is only allowed with stream=true")
        if self.logit_bias:
            raise ApiError("logit_bias is not supported")

    def to_params(self, max_tokens: int | None, logprobs: int | None, stream: bool) -> SamplingParams:
        fields: dict[str, Any] = {
            "n": self.n, "max_tokens": max_tokens, "min_tokens": self.min_tokens, "seed": self.seed,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output, "logprobs": logprobs,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "output_kind": OutputKind.DELTA if stream else OutputKind.FINAL_ONLY,
        }
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "min_p": self.min_p, "repetition_penalty": self.repetition_penalty}
        fields.update({k: v for k, v in optional.items() if v is not None})
        try:
            return SamplingParams(**fields)
        except (TypeError, ValueError) as e:  # msgspec raises ValueError subclasses on bad types
            if isinstance(e, SamplingParamsError):
                raise
            raise SamplingParamsError(f"invalid sampling params: {e}") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # strict: `true` is no token id
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: each choice (and each streamed chunk) also carries its generated token ids, and a full
    # response the prompt's; what a client of a model without a tokenizer reads, its text being empty
    return_token_ids: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string, one token-id list, or a batch of either."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and (not p or isinstance(p[0], int))):
            return [p]  # type: ignore[list-item]
        if len(p) > MAX_PROMPTS:
            raise ApiError(f"at most {MAX_PROMPTS} prompts per request")
        if not p:
            raise ApiError("prompt is empty")
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        self.check_common()
        if self.echo:
            raise ApiError("echo is not supported")
        if self.suffix:
            raise ApiError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError("best_of must equal n (or be omitted)")
        return self.to_params(self.max_tokens, self.logprobs, self.stream)


class ContentPart(BaseModel):
    model_config = STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise ApiError("only text content parts are supported")
            content = "".join(part.text or "" for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True  # vLLM extra

    def sampling_params(self) -> SamplingParams:
        self.check_common()
        if self.tools or self.tool_choice not in (None, "none"):
            raise ApiError("tools are not supported")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ApiError("only response_format {\"type\": \"text\"} is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.to_params(max_tokens, logprobs, self.stream)


# -- responses --------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


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


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


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
    delta: dict[str, str]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
