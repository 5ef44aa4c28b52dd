"""Requests in: a request's sampling params and prompt checked, and the prompt tokenized, before
anything is queued; every refusal is an InvalidRequestError that names what is wrong."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import SamplingParams
from asyncengine.tokenizer import max_token_chars

if TYPE_CHECKING:
    from asyncengine.structured_output import CompiledGrammar, GrammarCompiler

Prompt = str | list[int]
INLINE_TOKENIZE_CHARS = 4096  # shorter prompts tokenize on the loop (well under a millisecond)


class TokenizedPrompt(NamedTuple):
    """A text prompt already tokenized (off the event loop), with its text for the outputs."""

    text: str
    token_ids: list[int]


class ProcessedPrompt(NamedTuple):
    text: str | None  # None for a token-id prompt
    token_ids: list[int]
    max_tokens: int  # params.max_tokens, or what room the context leaves


class InputProcessor:
    def __init__(
        self, tokenizer: Any | None, vocab_size: int, max_model_len: int, eos_ids: Iterable[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_ids = set(eos_ids)
        self.grammar_compiler: GrammarCompiler | None = None  # built at the first structured request
        # no token is longer than this many characters, so a longer prompt cannot fit max_model_len:
        # refused before any tokenizing, which costs seconds on megabytes
        self.max_prompt_chars = max_model_len * max_token_chars(tokenizer)

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        params.validate()
        if self.vocab_size and any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {self.vocab_size})")
        return params

    def check_prompt_chars(self, prompt: str) -> None:
        if len(prompt) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} characters, more than max_model_len "
                f"({self.max_model_len}) tokens can hold"
            )

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids; slow on long prompts, so the engine calls it in a thread for those."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompt token ids")
        self.check_prompt_chars(prompt)
        try:
            return self.tokenizer.encode(prompt)
        except TypeError:  # the Rust tokenizer refuses what UTF-8 cannot hold: lone surrogates ("\ud800")
            raise InvalidRequestError("the prompt is not valid Unicode (a lone surrogate?)") from None

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar:
        """params.structured_outputs compiled for this tokenizer (cached); StructuredOutputError naming the
        field when it cannot be. Thread-safe: the engine compiles large ones off the event loop."""
        assert params.structured_outputs is not None
        if self.grammar_compiler is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs a tokenizer; this model has none")
            from asyncengine.structured_output import GrammarCompiler  # llguidance: only once it is used

            self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size or None, self.eos_ids)
        return self.grammar_compiler.compile(params.structured_outputs)

    def process(self, prompt: Prompt | TokenizedPrompt, params: SamplingParams) -> ProcessedPrompt:
        text: str | None
        if isinstance(prompt, TokenizedPrompt):  # before the list check: a NamedTuple is a tuple
            text, ids = prompt
        elif isinstance(prompt, str):
            text, ids = prompt, self.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids, text = list(prompt), None
            if len(ids) < self.max_model_len and any(  # a longer one is refused below, without the scan
                not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids
            ):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        else:
            raise InvalidRequestError(
                f"the prompt must be a string or a list of token ids, not {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        return ProcessedPrompt(text, ids, params.max_tokens if params.max_tokens is not None else room)
