"""Tokenizer loading; a model directory without tokenizer files works with token-id prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncengine.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(path: str) -> Any | None:
    if not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types here; one clear error for the user
        raise ConfigError(f"cannot load the tokenizer in {path}: {e}") from e


def eos_token_ids(model_dir: str, tokenizer: Any | None) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (any may be a list)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(model_dir) / name
        if f.exists():
            value = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def max_token_chars(tokenizer: Any | None) -> int:
    """An upper bound on the characters of text that one token covers.

    A vocabulary string has at least as many characters as the text it decodes to (byte-level BPE spells
    each byte with one character; SentencePiece spells a space with one "▁", a byte as "<0x0A>"); the
    factor 2 leaves room for normalizers that drop characters. 1 without a tokenizer (no text prompts).
    """
    if tokenizer is None:
        return 1
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 2 * max(longest, 8)
