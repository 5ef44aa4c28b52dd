"""Speculative decoding with n-gram prompt lookup: draft tokens copied from the sequence's own history.

When the last n tokens of a sequence (n from prompt_lookup_max down to prompt_lookup_min) occurred
before, the tokens that followed them then are proposed as the next ones. A step computes the last
token plus the drafts; the last stage samples after every one of them, and the engine keeps the
drafts up to the first one the model disagrees with, plus the model's own token there. Greedy output
is the one without speculation: every kept token is the model's argmax given the tokens before it.
A decode step on CPU is bound by reading the weights and the K/V (bench/RESULTS.md), so verifying a
few more rows per sequence costs far less than the steps that accepted drafts save, until the rows
make the GEMMs compute-bound: the scheduler's spec_token_budget caps them there.

Drafts are proposed by the scheduler, so every worker and stage gets them in the ExecuteModelRequest
like any scheduled token; only greedy requests without penalties, logprobs or a pending min_tokens
get them (their verification is an exact comparison).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for hints: a sequence never needs this module
    from asyncengine.sequence import Sequence


def accept_drafts(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the model agreed with. A step samples one token after each draft (len(drafts) + 1
    in all); the engine keeps the drafts up to the first that is not the model's own pick there, and
    then the model's pick: every kept token is the model's choice given the tokens before it."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


class NgramIndex:
    """n -> {the n tokens ending at position p: p + 1} for every p before the sequence's last token,
    the most recent occurrence winning; grown incrementally as the sequence grows. Measured: ~2 us a
    step (a token added, a lookup), ~340 bytes per token of the sequence for n = 1..3 (int-packed keys
    saved a fifth of that and cost 40% more time)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0  # n-grams ending before this position are in the tables

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the sequence's last n tokens."""
        end = len(token_ids) - 1  # index the n-grams ending at positions < end: never the tail itself
        for p in range(self.indexed, end):
            for n, table in self.tables.items():
                if p + 1 >= n:
                    table[tuple(token_ids[p + 1 - n : p + 1])] = p + 1
        self.indexed = max(self.indexed, end)
        for n in range(min(self.n_max, len(token_ids)), self.n_min - 1, -1):
            start = self.tables[n].get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start : start + k]
        return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.indexes: dict[int, NgramIndex] = {}  # seq_id -> its n-gram index, until the sequence finishes

    def forget(self, seq_id: int) -> None:
        self.indexes.pop(seq_id, None)

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Whether accepting drafts is an exact comparison: greedy, and nothing that depends on the
        tokens before each position (penalties, min_tokens) or reports on them (logprobs)."""
        p = seq.params
        return (
            p.temperature == 0.0
            and p.logprobs is None
            and p.repetition_penalty == 1.0
            and not p.presence_penalty
            and not p.frequency_penalty
            and seq.num_output_tokens >= p.min_tokens
        )

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """At most min(k, limit) draft tokens to follow the sequence's tokens."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        index = self.indexes.get(seq.seq_id)
        if index is None:
            index = self.indexes[seq.seq_id] = NgramIndex(self.n_min, self.n_max)
        return index.lookup(seq.token_ids, k)
