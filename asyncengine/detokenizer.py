"""Incremental detokenizer: streams text token by token, correct for multi-byte characters.

Decodes a small sliding window (prefix_offset..end) rather than the whole output each step; text is
emitted only once it no longer ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from typing import Any

# prompt tokens kept as left context: some tokenizers (SentencePiece) render a leading space
# differently at the start of a decode than in the middle of a text
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def append(self, token_id: int) -> str:
        """Adds one token; returns the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the stream, emits whatever is held back (even an incomplete character)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """The earliest stop string that ends after `search_from` (so it involves new text)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, search_from - len(stop) + 1))
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
