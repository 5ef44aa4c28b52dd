"""Engine-side state of requests and their sequences (one sequence per sample, n of them per request)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from asyncengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncengine.detokenizer import IncrementalDetokenizer
    from asyncengine.step_encoder import WorkerCopy
    from asyncengine.structured_output import GrammarMatcher


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    """One stream of tokens: the prompt plus what has been sampled so far, and its KV blocks."""

    def __init__(
        self,
        seq_id: int,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival: int,
    ) -> None:
        self.seq_id = seq_id
        self.index = index  # which of the request's n samples
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.arrival = arrival  # FCFS order, also the preemption order (newest first)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks already registered
        self.num_inflight_steps = 0  # scheduled in batches whose output has not come back
        self.num_inflight_tokens = 0  # tokens those batches compute
        self.num_pending_samples = 0  # tokens those batches will sample (async scheduling: at most 1)
        self.workers: WorkerCopy | None = None  # what the workers hold of it, so steps carry only diffs
        self.draft_token_ids: list[int] = []  # speculative decoding: the drafts its step in flight verifies
        self.aborted = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.detokenizer: IncrementalDetokenizer | None = None
        # structured output: the grammar state after its accepted tokens; the next token's mask comes
        # from it, so such a sequence never runs ahead of its sampled token
        self.grammar: GrammarMatcher | None = None
        self.num_streamed_tokens = 0  # for DELTA outputs
        self.num_streamed_chars = 0

    @property
    def on_workers(self) -> bool:
        return self.workers is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def in_flight(self) -> bool:
        return self.num_inflight_steps > 0

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to schedule, counting those in flight and the samples they will add."""
        return (
            len(self.token_ids)
            + self.num_pending_samples
            - self.num_computed_tokens
            - self.num_inflight_tokens
        )

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_ids)}, status={self.status.name})"
        )
