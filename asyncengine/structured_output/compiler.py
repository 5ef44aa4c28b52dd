"""GrammarCompiler: constraints compiled for one tokenizer, cached, and matchers made from them.

One per engine (per tokenizer). compile() is a plain blocking function (about 1 ms: llguidance builds
its lexer lazily, during the first masks) that releases the GIL while llguidance builds the grammar;
the engine calls it through asyncio.to_thread for large constraints, which compile under a time limit
(limits.py). It is thread-safe. A compiled grammar is a pristine
llguidance matcher that each request deep-copies, so requests with the same schema share the lexer
states the first of them built.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import llguidance

from asyncengine.structured_output.errors import StructuredOutputError
from asyncengine.structured_output.grammar import to_grammar
from asyncengine.structured_output.limits import compile_limited
from asyncengine.structured_output.matcher import GrammarMatcher
from asyncengine.structured_output.spec import KINDS, StructuredOutputsParams
from asyncengine.structured_output.tokenizer_info import build_ll_tokenizer

DEFAULT_CACHE_SIZE = 256
MAX_CACHE_CHARS = 64 * 2**20  # constraint and grammar text held by the cache, at most


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int
    max_size: int


class CompiledGrammar:
    __slots__ = ("key", "kind", "grammar", "_template", "_vocab_size", "_eos")

    def __init__(
        self,
        key: str,
        kind: str,
        grammar: str,
        template: llguidance.LLMatcher,
        vocab_size: int,
        eos: tuple[int, ...],
    ) -> None:
        self.key = key
        self.kind = kind
        self.grammar = grammar  # llguidance's grammar text
        self._template = template  # never advanced: only copied
        self._vocab_size = vocab_size
        self._eos = eos

    def matcher(self, extra_stop_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A new request's matcher at the start of the grammar."""
        return GrammarMatcher(self._template.deep_copy(), self._vocab_size, self._eos, extra_stop_token_ids)


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_token_ids: Iterable[int] = (),
        cache_size: int = DEFAULT_CACHE_SIZE,
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        """tokenizer: FastTokenizer, a transformers fast tokenizer or a tokenizers.Tokenizer.
        vocab_size: the model's (config.json; the masks' width), at least the tokenizer's.
        eos_token_ids: what a finished grammar allows (asyncengine.tokenizer.eos_token_ids)."""
        if cache_size < 1:
            raise ValueError("cache_size must be at least 1")
        self.ll_tokenizer = build_ll_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size: int = self.ll_tokenizer.vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(self.ll_tokenizer.eos_tokens)
        self._limits = limits
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._cache_chars = 0
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def compile(
        self, params: StructuredOutputsParams, names: Mapping[str, str] | None = None
    ) -> CompiledGrammar:
        """The compiled grammar of `params` (from the cache when seen); StructuredOutputError naming the
        field (see StructuredOutputsParams.validate for `names`) when it cannot be compiled."""
        try:
            if sum(params.is_set(k) for k in KINDS) != 1:
                raise ValueError("not exactly one constraint")
            key = params.cache_key()
        except (ValueError, TypeError):
            params.validate(names)  # raises the error that names the field
            raise
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return compiled
            self._misses += 1
        # also the types (a Struct built in Python skips msgspec's); once per key
        params.validate(names, key=key)
        kind = params.kind
        param = (names or {}).get(kind, f"structured_outputs.{kind}")
        compiled = compile_limited(key, param, lambda: self._compile(key, params, param))
        with self._lock:
            if key not in self._cache:
                self._cache_chars += len(key) + len(compiled.grammar)
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            # by count and by text: a few hundred distinct 500 KB schemas must not hold gigabytes
            while len(self._cache) > self._cache_size or (
                self._cache_chars > MAX_CACHE_CHARS and len(self._cache) > 1
            ):
                old_key, old = self._cache.popitem(last=False)
                self._cache_chars -= len(old_key) + len(old.grammar)
        return compiled

    def _compile(self, key: str, params: StructuredOutputsParams, param: str) -> CompiledGrammar:
        grammar = to_grammar(params)
        # log_level 0: errors are read back below, not printed on the engine's stderr
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():  # what only this tokenizer shows (validate() compiled without one)
            raise StructuredOutputError(template.get_error().strip(), param)
        return CompiledGrammar(key, params.kind, grammar, template, self.vocab_size, self.eos_token_ids)

    def matcher(
        self,
        params: StructuredOutputsParams,
        extra_stop_token_ids: Sequence[int] = (),
        names: Mapping[str, str] | None = None,
    ) -> GrammarMatcher:
        return self.compile(params, names).matcher(extra_stop_token_ids)

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._cache), self._cache_size)
