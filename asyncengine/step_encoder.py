"""The engine's side of the step message: what the workers hold of each sequence, and the diffs that
keep them in step. The mirror of worker/input_batch.py, which applies what this writes.

A sequence the workers have not seen (or dropped: preempted) goes as a NewSeq with its tokens, blocks
and sampling options; after that each step carries a CachedSeq with only what changed since: tokens
appended (with async scheduling the worker appends what it sampled itself, so those are not resent),
blocks added, drafts to verify and the rejected drafts of the last step to drop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from asyncengine.transport.wire import (
    CachedSeq,
    ExecuteModelRequest,
    NewSeq,
    SamplingOptions,
    pack_ids,
    unpack_ids,
)

# what encoding raises on a value msgpack or int32 cannot hold (ints past 64 bits, ...)
ENCODE_ERRORS = (OverflowError, TypeError, ValueError, msgspec.EncodeError)

if TYPE_CHECKING:
    from asyncengine.scheduler import ScheduledSeq, SchedulerOutput
    from asyncengine.sequence import Sequence


@dataclass
class WorkerCopy:
    """What the workers hold of one sequence (Sequence.workers; None while they hold nothing)."""

    num_tokens: int = 0
    num_blocks: int = 0
    num_rejected: int = 0  # computed drafts the model rejected: the next step tells the workers to drop them


class EncodedStep(NamedTuple):
    request: ExecuteModelRequest
    new_items: list[ScheduledSeq]  # in the order of request.new_seqs
    cached_items: list[ScheduledSeq]  # in the order of request.cached_seqs

    @property
    def items(self) -> list[ScheduledSeq]:
        """The scheduled sequences in the workers' order (new ones first): the order of their outputs."""
        return self.new_items + self.cached_items


class StepEncoder:
    def __init__(self, eos_ids: set[int], run_ahead: bool) -> None:
        self.eos_ids = eos_ids
        self.run_ahead = run_ahead  # the workers append what they sample (async scheduling)

    def encode(self, step_id: int, sched: SchedulerOutput) -> EncodedStep:
        """The step's message; records what the workers will hold once they have it."""
        new_seqs: list[NewSeq] = []
        cached: list[CachedSeq] = []
        new_items: list[ScheduledSeq] = []
        cached_items: list[ScheduledSeq] = []
        for item in sched.scheduled:
            seq, num, samples = item
            copy = seq.workers
            if copy is None:
                new_seqs.append(
                    NewSeq(
                        seq.seq_id,
                        pack_ids(seq.token_ids),
                        seq.num_prompt_tokens,
                        list(seq.block_ids),
                        seq.num_computed_tokens,
                        num,
                        self.options(seq),
                    )
                )
                new_items.append(item)
                seq.workers = copy = WorkerCopy()
            else:
                drafts = seq.draft_token_ids
                cached.append(
                    CachedSeq(
                        seq.seq_id,
                        num,
                        seq.token_ids[copy.num_tokens :] + drafts,
                        seq.block_ids[copy.num_blocks :],
                        copy.num_rejected,
                        len(drafts),
                    )
                )
                copy.num_rejected = 0  # sent; set again once this step's drafts are verified
                cached_items.append(item)
            copy.num_tokens = max(copy.num_tokens, seq.num_tokens)
            copy.num_blocks = len(seq.block_ids)
            if samples and self.run_ahead:
                copy.num_tokens += 1  # the worker appends what it samples itself
        # the masks of constrained sequences that sample (their grammar has seen every token before it)
        masked = [item.seq for item in sched.scheduled if item.samples and item.seq.grammar is not None]
        request = ExecuteModelRequest(
            step_id,
            new_seqs,
            cached,
            sched.dropped_seq_ids,
            [seq.seq_id for seq in masked],
            b"".join(seq.grammar.bitmask() for seq in masked),  # type: ignore[union-attr]
        )
        return EncodedStep(request, new_items, cached_items)

    def options(self, seq: Sequence) -> SamplingOptions:
        p = seq.params
        banned = sorted(self.eos_ids | set(p.stop_token_ids)) if p.min_tokens else []
        if p.ignore_eos:
            banned = sorted(set(p.stop_token_ids)) if p.min_tokens else []
        return SamplingOptions(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=None if p.seed is None else (p.seed + seq.index) % 2**63,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logprobs=p.logprobs,
            min_tokens=p.min_tokens,
            min_tokens_banned_ids=banned,
        )

    @staticmethod
    def on_drafts_verified(seq: Sequence, num_drafts: int, accepted: int) -> None:
        """After the step that verified seq's drafts (and before its tokens are appended): the workers
        hold the kept drafts, which are the engine's next tokens, and drop the rejected ones next step."""
        assert seq.workers is not None
        seq.workers.num_rejected = num_drafts - accepted
        seq.workers.num_tokens = seq.num_tokens + accepted

    @staticmethod
    def unencodable(step: EncodedStep) -> dict[int, Exception]:
        """seq_id -> the error, for each sequence whose part of the step does not encode."""
        failed: dict[int, Exception] = {}
        for part in step.request.new_seqs + step.request.cached_seqs:
            try:
                msgspec.msgpack.encode(part)
                if isinstance(part, NewSeq):
                    unpack_ids(part.token_ids)
            except ENCODE_ERRORS as e:
                failed[part.seq_id] = e
        return failed

    @staticmethod
    def without(step: EncodedStep, drop: set[int]) -> EncodedStep:
        """The step without the sequences whose ids are in `drop`."""
        r = step.request
        grammar_ids, grammar_bitmask = r.grammar_seq_ids, r.grammar_bitmask
        if grammar_ids and drop & set(grammar_ids):
            width = len(r.grammar_bitmask) // len(r.grammar_seq_ids)
            keep = [i for i, s in enumerate(r.grammar_seq_ids) if s not in drop]
            grammar_ids = [r.grammar_seq_ids[i] for i in keep]
            grammar_bitmask = b"".join(r.grammar_bitmask[i * width : (i + 1) * width] for i in keep)
        request = ExecuteModelRequest(
            r.step_id,
            [s for s in r.new_seqs if s.seq_id not in drop],
            [s for s in r.cached_seqs if s.seq_id not in drop],
            r.finished_seq_ids,
            grammar_ids,
            grammar_bitmask,
        )
        return EncodedStep(
            request,
            [i for i in step.new_items if i.seq.seq_id not in drop],
            [i for i in step.cached_items if i.seq.seq_id not in drop],
        )
