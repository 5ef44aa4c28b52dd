"""The vocabulary as llguidance sees it (an LLTokenizer), built once per tokenizer.

Built from the `tokenizers` JSON of the engine's tokenizer (FastTokenizer's backend, or a transformers
fast tokenizer's, or a tokenizers.Tokenizer), so neither torch nor transformers is imported: the engine
process builds it (issue 20's layering). About 10 ms for a 4k vocabulary, about 1 s for 128k.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import llguidance

from asyncengine.errors import ConfigError


def _backend(tokenizer: Any) -> Any:
    """The tokenizers.Tokenizer behind `tokenizer` (or itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str") or not hasattr(backend, "get_vocab_size"):
        raise ConfigError(
            f"structured output needs a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}"
        )
    return backend


def tokenizer_json(tokenizer: Any) -> str:
    """tokenizer.json text of `tokenizer` with its added tokens, without padding or truncation (which
    would change how llguidance re-tokenizes forced text)."""
    raw = json.loads(_backend(tokenizer).to_str())
    raw["padding"] = None
    raw["truncation"] = None
    return json.dumps(raw)


def tokenizer_size(tokenizer: Any) -> int:
    return int(_backend(tokenizer).get_vocab_size(with_added_tokens=True))


def build_ll_tokenizer(
    tokenizer: Any, vocab_size: int | None = None, eos_token_ids: Iterable[int] = ()
) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` for masks of `vocab_size` tokens.

    vocab_size is the model's (config.json): it may exceed the tokenizer's (embeddings padded to a
    multiple of 64 or 128): those ids have no text and are never allowed. A model vocabulary smaller
    than the tokenizer's keeps the tokenizer's size (the masks are then wider than the logits; the
    worker's apply ignores the extra bits). eos_token_ids are the tokens a finished grammar allows
    (all of generation_config's, e.g. <|endoftext|> and <|im_end|>); default: the tokenizer's EOS."""
    size = tokenizer_size(tokenizer)
    eos = sorted(set(eos_token_ids))
    if not eos:
        eos_id = getattr(tokenizer, "eos_token_id", None)
        if eos_id is None:
            raise ConfigError("structured output needs an EOS token id (none in the model or tokenizer)")
        eos = [int(eos_id)]
    n_vocab = max(size, vocab_size or 0)
    if any(not 0 <= e < n_vocab for e in eos):
        raise ConfigError(f"EOS token ids {eos} out of the vocabulary of {n_vocab}")
    return llguidance.LLTokenizer(tokenizer_json(tokenizer), n_vocab=n_vocab, eos_token=eos)
