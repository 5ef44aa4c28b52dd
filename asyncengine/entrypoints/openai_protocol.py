"""Pydantic models of the requests of OpenAI's /v1/completions and /v1/chat/completions, plus vLLM's
sampling extras and its /tokenize and /detokenize (their answers: openai_responses.py).

Unknown fields are refused with a 400 naming them, as OpenAI does (`max_token` is a typo, not a request
for the default). Every field OpenAI's API defines is known, and vLLM's common extras, so SDKs and
frameworks never meet that 400 for a legitimate field; those we do not implement are either harmless
hints, accepted and ignored (`user`, `metadata`, `store`, ...), or accepted only at their neutral value
(what asking for nothing looks like: `echo: false`, `audio: null`) and otherwise refused with a 400 that
names them (see `NEUTRAL`). Types are strict, as OpenAI's are: `"4"`, `true` and `2.0` are no integers (an
integer passes as a float); ranges are SamplingParams' own checks, which name the field. OpenAI's
nullable fields take null as "the default". Structured output (response_format, vLLM's
structured_outputs and its guided_* aliases) and tools are checked by asyncengine.structured_output and
tool_parsers, whose errors name the offending part (`response_format.json_schema.schema`, `tools[0]...`).
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictInt

from asyncengine.entrypoints.api_errors import ApiError
from asyncengine.entrypoints.chat_protocol import ChatTemplateFields, ChatToolFields
from asyncengine.entrypoints.request_model import RequestModel
from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import OutputKind, SamplingParams, SamplingParamsError
from asyncengine.structured_output import StructuredOutputsParams, structured_outputs_from_request

MAX_PROMPTS = 256  # prompts in one batched /v1/completions request


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels: ignored
    continuous_usage_stats: bool | None = False  # vLLM's
    NEUTRAL = {"continuous_usage_stats": (None, False)}


# vLLM's extras this server does not implement, shared by both endpoints, at their neutral values
_VLLM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "priority": (0,),
    "cache_salt": (None,),
}


class SamplingFields(RequestModel):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    NEUTRAL = _VLLM_NEUTRAL

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # refused unless empty
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: ignored
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM extras not implemented: accepted at their neutral values only (_VLLM_NEUTRAL)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    priority: int = 0
    cache_salt: str | None = None
    # structured output: vLLM's object, and its older aliases (one spelling per request, or a 400)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}; checked by
    # structured_outputs_from_request, which names the offending part (response_format.json_schema.schema)
    response_format: dict[str, Any] | None = None

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError("stream_options is only allowed with stream=true", param="stream_options")
        if self.logit_bias:
            raise ApiError("logit_bias is not supported", param="logit_bias")
        self.check_neutral()
        if self.stream_options is not None:
            self.stream_options.check_neutral()

    @property
    def constrains(self) -> bool:
        """Whether the request may carry a constraint, whose checking compiles it (0.3 s for a 250 KB
        schema): then the routes build its params off the event loop."""
        fields = (self.structured_outputs, self.response_format, self.guided_json, self.guided_regex)
        fields += (self.guided_choice, self.guided_grammar, self.guided_whitespace_pattern)
        return any(f is not None for f in fields)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint of whichever spelling the request used (validated: it compiles)."""
        return structured_outputs_from_request(
            self.structured_outputs,
            self.response_format,
            guided_json=self.guided_json,
            guided_regex=self.guided_regex,
            guided_choice=self.guided_choice,
            guided_grammar=self.guided_grammar,
            guided_whitespace_pattern=self.guided_whitespace_pattern,
        )

    def to_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        stream: bool,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        fields: dict[str, Any] = {
            "n": 1 if self.n is None else self.n,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "output_kind": OutputKind.DELTA if stream else OutputKind.FINAL_ONLY,
            "structured_outputs": structured_outputs,
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        try:
            return SamplingParams(**fields)
        except (TypeError, ValueError) as e:  # msgspec raises ValueError subclasses on bad types
            if isinstance(e, InvalidRequestError):  # SamplingParamsError, StructuredOutputError: named
                raise
            raise SamplingParamsError(f"invalid sampling params: {e}") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    NEUTRAL = {
        **_VLLM_NEUTRAL,
        "echo": (None, False),
        "suffix": (None, ""),
        "add_special_tokens": (True,),
    }

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # strict: `true` is no token id
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: each choice (and each streamed chunk) also carries its generated token ids, and a full
    # response the prompt's; what a client of a model without a tokenizer reads, its text being empty
    return_token_ids: bool = False
    add_special_tokens: bool = True  # vLLM's; the engine's encoding always adds them

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string, one token-id list, or a batch of either."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and (not p or isinstance(p[0], int))):
            return [p]  # type: ignore[list-item]
        if len(p) > MAX_PROMPTS:
            raise ApiError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        if not p:
            raise ApiError("prompt is empty", param="prompt")
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        self.check_common()
        if self.best_of is not None and self.best_of != (1 if self.n is None else self.n):
            raise ApiError("best_of must equal n (or be omitted)", param="best_of")
        structured = self.structured_outputs_params()
        return self.to_params(self.max_tokens, self.logprobs, bool(self.stream), structured)


class ChatCompletionRequest(ChatToolFields, SamplingFields):
    NEUTRAL = {
        **_VLLM_NEUTRAL,
        "functions": (None, []),
        "function_call": (None, "none", "auto"),
        "audio": (None,),
        "modalities": (None, ["text"]),
        "web_search_options": (None,),
        "moderation": (None,),
        "chat_template": (None,),
        "documents": (None,),
        "echo": (False,),
        "return_token_ids": (None, False),
        "best_of": (None, 1),
    }

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    reasoning_effort: str | None = None  # passed to the chat template (which may ignore it)
    # OpenAI's hints and bookkeeping, with no effect on what is generated here: ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None  # predicted output: a speed-up, the output is the same
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # OpenAI's features not implemented: accepted at their neutral values only (NEUTRAL)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # vLLM's, not implemented
    echo: bool = False
    return_token_ids: bool | None = None
    best_of: int | None = None

    def sampling_params(self) -> SamplingParams:
        self.check_common()
        structured = self.structured_outputs_params()
        forced = self.tool_structured_outputs()
        if forced is not None and structured is not None:
            raise ApiError(
                "tool_choice 'required' or a named tool constrains the output to the call: it cannot be "
                "combined with response_format, structured_outputs or guided_*",
                param="tool_choice",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.to_params(max_tokens, logprobs, bool(self.stream), forced or structured)

    @property
    def constrains(self) -> bool:
        return super().constrains or bool(self.tools)  # "required" / a named tool compile the tools' schemas

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = super().template_kwargs()
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs


# -- vLLM's /tokenize and /detokenize ------------------------------------------------------------------
class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplateFields):
    NEUTRAL = {"chat_template": (None,), "documents": (None,)}

    model: str | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[StrictInt]
