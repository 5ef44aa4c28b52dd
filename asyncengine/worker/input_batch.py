"""The worker's persistent per-sequence state, so that each step only carries diffs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncengine.layers.sampler import PenaltyState, has_penalties
from asyncengine.transport.wire import CachedSeq, ExecuteModelRequest, NewSeq, SamplingOptions, unpack_ids


@dataclass
class SeqState:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingOptions
    generator: torch.Generator | None = None  # per-sequence, so seeded sampling ignores batch composition
    output_counts: dict[int, int] = field(default_factory=dict)  # for presence / frequency penalties
    penalties: PenaltyState | None = None  # the same as arrays for the sampler, where it has penalties

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append(self, token_ids: list[int]) -> None:
        for t in token_ids:
            self.token_ids.append(t)
            self.output_counts[t] = self.output_counts.get(t, 0) + 1
            if self.penalties is not None:
                self.penalties.add(t)

    def rollback(self, num: int) -> None:
        """Forgets its last `num` tokens, computed drafts the model rejected (their K/V slots are
        simply written again by the tokens that take their places)."""
        for t in self.token_ids[-num:]:
            self.output_counts[t] -= 1
            if not self.output_counts[t]:
                del self.output_counts[t]
            if self.penalties is not None:
                self.penalties.remove(t)
        del self.token_ids[-num:]
        self.num_computed_tokens -= num


@dataclass
class StepBatch:
    """This step's sequences in the engine's order, with the tokens to compute for each."""

    step_id: int
    seqs: list[SeqState]
    num_scheduled: list[int]
    num_drafts: list[int]  # of the scheduled tokens, the last ones that are drafts (speculative decoding)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled)


class InputBatch:
    """seq_id -> SeqState, updated from each ExecuteModelRequest."""

    def __init__(self, device: torch.device, vocab_size: int = 0) -> None:
        self.seqs: dict[int, SeqState] = {}
        self.device = device
        self.vocab_size = vocab_size  # the logits' width, for PenaltyState (0: unknown, none kept)

    def update(self, req: ExecuteModelRequest) -> StepBatch:
        for seq_id in req.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        seqs: list[SeqState] = []
        num_scheduled: list[int] = []
        num_drafts: list[int] = []
        for new in req.new_seqs:
            state = self._add(new)
            seqs.append(state)
            num_scheduled.append(new.num_scheduled_tokens)
            num_drafts.append(0)
        for diff in req.cached_seqs:
            state = self._apply(diff)
            seqs.append(state)
            num_scheduled.append(diff.num_scheduled_tokens)
            num_drafts.append(diff.num_draft_tokens)
        return StepBatch(req.step_id, seqs, num_scheduled, num_drafts)

    def _add(self, new: NewSeq) -> SeqState:
        token_ids = unpack_ids(new.token_ids)
        state = SeqState(
            new.seq_id,
            token_ids,
            new.num_prompt_tokens,
            list(new.block_ids),
            new.num_computed_tokens,
            new.sampling,
        )
        for t in token_ids[new.num_prompt_tokens :]:
            state.output_counts[t] = state.output_counts.get(t, 0) + 1
        if self.vocab_size and has_penalties(new.sampling):
            state.penalties = PenaltyState(token_ids, new.num_prompt_tokens, self.vocab_size)
        if new.sampling.seed is not None:
            state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed(new.sampling.seed)
        self.seqs[new.seq_id] = state
        return state

    def _apply(self, diff: CachedSeq) -> SeqState:
        state = self.seqs[diff.seq_id]
        if not 0 <= diff.num_rejected <= state.num_output_tokens or not 0 <= diff.num_draft_tokens < max(
            diff.num_scheduled_tokens, 1
        ):
            raise ValueError(
                f"sequence {diff.seq_id}: {diff.num_rejected} rejected and {diff.num_draft_tokens} draft "
                f"tokens do not fit {state.num_output_tokens} outputs and {diff.num_scheduled_tokens} "
                "scheduled tokens"
            )
        if diff.num_rejected:
            state.rollback(diff.num_rejected)
        if diff.new_token_ids:
            state.append(diff.new_token_ids)
        if diff.new_block_ids:
            state.block_ids.extend(diff.new_block_ids)
        return state

    def mark_computed(self, batch: StepBatch) -> None:
        for state, num in zip(batch.seqs, batch.num_scheduled):
            state.num_computed_tokens += num
