"""Turns sampled tokens into RequestOutputs: stop conditions, incremental text, logprobs, deltas."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncengine.detokenizer import IncrementalDetokenizer, find_stop
from asyncengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams
from asyncengine.sequence import Sequence
from asyncengine.transport.wire import TokenLogprobs

if TYPE_CHECKING:
    from asyncengine.stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    done: bool = False

    @property
    def all_finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    """The live requests' states: sampled tokens in (stops, text, logprobs), RequestOutputs out to each
    request's queue, which its consumer (AsyncEngine.generate) reads."""

    def __init__(
        self, tokenizer: Any | None, eos_ids: set[int], max_model_len: int, stats: EngineStats
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.stats = stats
        self.requests: dict[str, RequestState] = {}

    def add_request(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        self.stats.on_arrival(len(state.prompt_token_ids))
        if self.tokenizer is None:
            return
        for seq in state.seqs:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, state.prompt_token_ids, state.params.skip_special_tokens
            )

    def append_sampled(
        self,
        state: RequestState,
        seq: Sequence,
        token_ids: list[int],
        logprobs: TokenLogprobs | None,
        now: float,
    ) -> None:
        """Appends a step's kept tokens (the sampled one, or accepted drafts and the model's pick after
        them) up to the first that finishes the sequence; the logprobs are the first token's."""
        for i, token in enumerate(token_ids):
            self.append_token(seq, token, logprobs if i == 0 else None)
            self.stats.on_new_token(state, now)
            if seq.finish_reason is not None:  # a stop inside the accepted drafts ends it there
                break
        state.metrics.last_token_time = now

    def publish(self, states: Iterable[RequestState]) -> None:
        """Streams each request's new output after a step (its final one if it finished)."""
        for state in states:
            if state.all_finished:
                self.finish(state)
            elif (out := self.make_output(state)) is not None:
                state.queue.put_nowait(out)

    def finish(self, state: RequestState, error: BaseException | None = None) -> None:
        """Ends a request: its consumer gets the final output, or `error` raised."""
        if state.done:
            return
        state.done = True
        self.requests.pop(state.request_id, None)
        if error is not None:
            state.queue.put_nowait(error)
        elif (out := self.make_output(state)) is not None:
            out.finished = True
            state.queue.put_nowait(out)
        state.metrics.finished_time = time.monotonic()
        self.stats.on_finished(state)

    def fail_all(self, error: BaseException) -> None:
        """Every live request's consumer gets `error` raised (the engine is dead)."""
        for state in self.requests.values():
            state.done = True
            state.queue.put_nowait(error)
        self.requests.clear()

    def append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        """Appends a sampled token and sets finish_reason when a stop condition holds."""
        params = seq.params
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.cumulative_logprob += logprobs.logprobs[0]
            if seq.logprobs is not None:
                seq.logprobs.append(self._logprob_dict(logprobs))
        n_out = seq.num_output_tokens
        text_before = len(seq.detokenizer.text) if seq.detokenizer else 0
        if seq.detokenizer is not None:
            seq.detokenizer.append(token)
        may_stop = n_out >= params.min_tokens
        grammar_done = seq.grammar is not None and self._advance_grammar(seq, token)
        if may_stop and not params.ignore_eos and token in self.eos_ids:
            seq.finish_reason = "stop"
        elif may_stop and token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif may_stop and params.stop and seq.detokenizer is not None:
            hit = find_stop(seq.detokenizer.text, params.stop, text_before)
            if hit is not None:
                idx, stop = hit
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                seq.detokenizer.text = seq.detokenizer.text[:end]
                seq.finish_reason, seq.stop_reason = "stop", stop
        if seq.finish_reason is None and grammar_done:
            seq.finish_reason = "stop"  # the output is complete: only EOS could follow
        if seq.finish_reason is None and (n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None and seq.detokenizer is not None and seq.stop_reason is None:
            seq.detokenizer.flush()

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> bool:
        """Feeds the grammar the sampled token; True when the output is complete (nothing but EOS may
        follow). The mask allowed only tokens the grammar accepts, so a refusal is a bug: logged, and
        the grammar is dropped rather than the request failed."""
        grammar = seq.grammar
        assert grammar is not None
        if not grammar.accept_token(token):
            logger.error(
                "sequence %d: token %d was sampled outside its grammar (%s); the rest is unconstrained",
                seq.seq_id,
                token,
                grammar.error or "refused",
            )
            seq.grammar = None
            return False
        return grammar.is_stopped()

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        out: dict[int, Logprob] = {}
        for token, value, rank in zip(lp.token_ids, lp.logprobs, lp.ranks or [0] * len(lp.token_ids)):
            if token not in out:
                decoded = self.tokenizer.decode([token]) if self.tokenizer is not None else None
                out[token] = Logprob(value, rank, decoded)
        return out

    def make_output(self, state: RequestState) -> RequestOutput | None:
        """The RequestOutput to stream now, or None (FINAL_ONLY before the end)."""
        params = state.params
        finished = state.all_finished
        if params.output_kind == OutputKind.FINAL_ONLY and not finished:
            return None
        delta = params.output_kind == OutputKind.DELTA
        holdback = max((len(s) for s in params.stop), default=1) - 1
        outputs = []
        for seq in state.seqs:
            text = seq.detokenizer.text if seq.detokenizer is not None else ""
            if seq.finish_reason is None and holdback:
                text = text[: max(0, len(text) - holdback)]  # a stop string may still be completing
            token_ids = seq.output_token_ids
            logprobs = seq.logprobs
            if delta:
                text_out = text[seq.num_streamed_chars :]
                ids_out = token_ids[seq.num_streamed_tokens :]
                lps_out = logprobs[seq.num_streamed_tokens :] if logprobs is not None else None
                seq.num_streamed_chars = len(text)
                seq.num_streamed_tokens = len(token_ids)
                text, token_ids, logprobs = text_out, ids_out, lps_out
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=list(logprobs) if logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, outputs, finished, state.metrics
        )
