"""GrammarMatcher: one request's place in its grammar, fed every token the request accepts.

The engine keeps one per constrained request: before a step it fills the request's row of the step's
bitmask (the tokens the grammar allows next), after the step it accepts the sampled token (or, with
speculative decoding, validates the drafts, accepts the verified ones and rolls back the rest).

EOS: the stop tokens (the model's EOS ids, plus any the request adds with stop_token_ids) are allowed
exactly when the output so far is a complete match (`is_accepting()`), beside whatever may still
extend it (more digits of "[0-9]+"); accepting one terminates the matcher. A grammar that can take no
more text (a choice fully written, a closed JSON object) is `is_stopped()`: the engine may end the
request there (finish_reason "stop") instead of spending a step on the only token left, EOS.

The mask can be stricter than accept_token: where the grammar forces text (a literal, the rest of an
enum value), llguidance allows only that text's canonical tokens ("SELECT" as "SE"+"LE"+"CT", not
"S"+"EL"...), while accept_token takes any tokens that spell it. Sampled tokens always pass both.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from asyncengine.structured_output.bitmask import allocate_bitmask, bitmask_words, set_allowed


class GrammarMatcher:
    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        extra_stop_token_ids: Sequence[int] = (),
    ) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)  # the ones llguidance knows (its LLTokenizer's)
        # a request's own stop ids: allowed where EOS is, and accepted as EOS
        self._extra_stop = tuple(
            sorted({t for t in extra_stop_token_ids if 0 <= t < vocab_size and t not in self._eos})
        )
        self._num_tokens = 0
        self._terminated_at: int | None = None  # num_tokens just after the accepted stop token
        self._stop_in_llguidance = False  # whether llguidance consumed that stop token

    # -- state -----------------------------------------------------------------------------------------
    @property
    def num_words(self) -> int:
        return bitmask_words(self.vocab_size)

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (what rollback can undo)."""
        return self._num_tokens

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """What a finished match allows."""
        return self._eos + self._extra_stop

    @property
    def error(self) -> str | None:
        """llguidance's error, if the matcher broke (a parser limit hit mid-generation)."""
        return self._m.get_error() or None

    def is_accepting(self) -> bool:
        """The output so far is a complete match: a stop token is allowed now."""
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        """Nothing but a stop token can follow (or one was accepted): the output is final."""
        return self._terminated_at is not None or self._m.is_stopped()

    def is_terminated(self) -> bool:
        """A stop token was accepted."""
        return self._terminated_at is not None

    # -- masks ------------------------------------------------------------------------------------------
    def fill_bitmask(self, out: np.ndarray, row: int = 0) -> None:
        """Writes the allowed next tokens into out[row] (int32 [rows, num_words], C-contiguous)."""
        if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != self.num_words:
            raise ValueError(f"bitmask must be int32 [rows, {self.num_words}], got {out.dtype} {out.shape}")
        if self._terminated_at is not None:
            self._finish_row(out[row])
            return
        llguidance.numpy.fill_next_token_bitmask(self._m, out, row)
        self._finish_row(out[row])

    def _finish_row(self, row: np.ndarray) -> None:
        if self._terminated_at is not None:  # finished: the stop tokens, should anyone still ask
            row[:] = 0
            set_allowed(row, self.stop_token_ids)
        elif self._extra_stop and self._m.is_accepting():
            set_allowed(row, self._extra_stop)

    def bitmask(self) -> bytes:
        """The next-token mask as 4 * num_words bytes (little-endian int32 words)."""
        out = allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask(out)
        return out.tobytes()

    # -- tokens -----------------------------------------------------------------------------------------
    def accept_token(self, token_id: int) -> bool:
        """Advances by one token; False (state unchanged) if the grammar does not allow it."""
        if self._terminated_at is not None or not 0 <= token_id < self.vocab_size:
            return False  # out of range would put llguidance in its permanent error state
        if token_id in self._eos or token_id in self._extra_stop:
            if not self._m.is_accepting():
                return False
            if self._m.is_stopped():
                # llguidance takes no token once stopped, EOS included (try_consume_tokens says 0, and
                # consume_token says yes without recording it, so a rollback would undo the token
                # before): the stop is recorded here only
                self._stop_in_llguidance = False
            elif self._m.try_consume_tokens([self._eos[0]]) == 1:
                self._stop_in_llguidance = True
            else:
                return False
            self._num_tokens += 1
            self._terminated_at = self._num_tokens
            return True
        # try_consume_tokens rejects without the error state consume_token would enter
        if self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._num_tokens += 1
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Accepts tokens up to the first the grammar rejects; returns how many it accepted."""
        for i, t in enumerate(token_ids):
            if not self.accept_token(int(t)):
                return i
        return len(token_ids)

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of token_ids (a speculative draft) accept_tokens would take; the state is unchanged."""
        accepted = self.accept_tokens(token_ids)
        self.rollback(accepted)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accepted tokens (a stop token among them included)."""
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self._num_tokens} accepted tokens")
        if num_tokens == 0:
            return
        in_llguidance = num_tokens
        if self._terminated_at is not None and not self._stop_in_llguidance:
            in_llguidance -= 1  # the stop token is last, and llguidance never saw it
        if in_llguidance and not self._m.rollback(in_llguidance):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self._m.get_error()}")
        self._num_tokens -= num_tokens
        if self._terminated_at is not None and self._num_tokens < self._terminated_at:
            self._terminated_at = None

    def reset(self) -> None:
        self._m.reset()
        self._num_tokens = 0
        self._terminated_at = None
        self._stop_in_llguidance = False


def fill_bitmasks(
    rows: Sequence[tuple[GrammarMatcher, int]],
    out: np.ndarray,
    executor: llguidance.LLExecutor | None = None,
) -> None:
    """Fills out[row] for each (matcher, row); other rows are left as they are.

    With an executor (llguidance.LLExecutor(num_threads)) the masks are computed in parallel, outside
    the GIL; without, one after the other (fine for a few rows: a mask takes 5-50 us)."""
    if not rows:
        return
    if executor is None:
        for matcher, row in rows:
            matcher.fill_bitmask(out, row)
        return
    words = rows[0][0].num_words
    if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != words:
        raise ValueError(f"bitmask must be int32 [rows, {words}], got {out.dtype} {out.shape}")
    live = [(m._m, r) for m, r in rows if not m.is_terminated()]
    if live:
        llguidance.numpy.fill_next_token_bitmask_par(executor, live, out)
    for matcher, row in rows:
        matcher._finish_row(out[row])
