"""Token bitmasks as numpy arrays: the form the engine fills and the step message carries.

A mask row is ceil(vocab_size / 32) int32 words; token t is allowed iff bit t % 32 of word t // 32 is
set. As bytes (little-endian words) that is bit t % 8 of byte t // 8, LSB first: the layout of
llguidance, xgrammar and vLLM, which asyncengine.layers.grammar_mask applies to the logits.
"""

from __future__ import annotations

import sys

import numpy as np

# the byte view above assumes little-endian words (every platform torch ships for)
assert sys.byteorder == "little", "token bitmasks assume a little-endian host"


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """[rows, words] int32, all tokens allowed (-1 = every bit set)."""
    return np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def allowed_token_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids a mask row allows (for tests and debugging: O(vocab))."""
    bits = np.unpackbits(np.ascontiguousarray(row, dtype=np.int32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def is_allowed(row: np.ndarray, token_id: int) -> bool:
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


def set_allowed(row: np.ndarray, token_ids: list[int] | tuple[int, ...]) -> None:
    words = row.view(np.uint32)  # no sign trouble with bit 31
    for t in token_ids:
        words[t // 32] |= np.uint32(1 << (t % 32))
