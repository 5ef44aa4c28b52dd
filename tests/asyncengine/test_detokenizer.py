"""Incremental detokenization equals a full decode, for multi-byte characters split across tokens."""

from __future__ import annotations

import pytest
import transformers
from tiny_models import build_tokenizer

from asyncengine.detokenizer import IncrementalDetokenizer, find_stop

TEXTS = [
    "Héllo wörld! ¿Qué tal?",
    "日本語のテキスト 🙂🚀✨ emoji",
    "def fibonacci(n):\n    return n",
    "🙂" * 5 + "x",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = build_tokenizer(tmp_path_factory.mktemp("tok"))
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tokenizer, text: str) -> None:
    prompt = tokenizer.encode("prompt: ")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    pieces = [detok.append(t) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_byte_fallback_split_character_is_held_back(tokenizer) -> None:
    # the raw bytes of an emoji as separate byte tokens: nothing may be emitted until it completes
    byte_tokens = [
        tokenizer.convert_tokens_to_ids(t) for t in tokenizer.convert_ids_to_tokens(tokenizer.encode("🚀"))
    ]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    out = [detok.append(t) for t in byte_tokens]
    assert "".join(out) + detok.flush() == "🚀"


def test_find_stop_only_searches_new_text() -> None:
    assert find_stop("abc STOP def", ["STOP"], 5) == (4, "STOP")
    assert find_stop("STOP then more", ["STOP"], 10) is None
    assert find_stop("xxSTOyyST", ["STOP", "yy"], 5) == (5, "yy")
