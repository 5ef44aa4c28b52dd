"""Scheduler: continuous batching under a token budget, chunked prefill, preemption by recompute.

Each call to `schedule()` builds one batch from sequences that are not already in flight, so with
pipeline parallelism several batches of disjoint sequences can be in the pipeline at once. With
`num_batches` = P > 1 a batch holds at most ceil(active / P) sequences, or the first batch takes every
sequence, the next finds none left, and P - 1 stages sit idle; and ceil(max_num_batched_tokens / P)
tokens, so the pipeline as a whole holds one step's budget and a burst of prompts reaches the last
stage after 1/P of a full step instead of leaving it idle for a whole one.

With speculative decoding (a `proposer`), a decoding sequence's step also computes its draft tokens
(spec_decode.py), within the batch's token budget and `spec_token_budget`; the step then samples after
each of them, and `on_step_done` counts only the drafts the model agreed with as computed.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from asyncengine.block_manager import BlockManager
from asyncengine.errors import ConfigError
from asyncengine.sequence import Sequence, SequenceStatus
from asyncengine.spec_decode import NgramProposer

if TYPE_CHECKING:
    from asyncengine.config import EngineConfig


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_tokens: int  # tokens to compute this step: 1 for decode, a chunk of the prompt for prefill
    samples: bool  # this step reaches the end of the sequence and samples its next token


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledSeq]
    dropped_seq_ids: list[int]  # sequences the workers must forget (finished, aborted, preempted)
    num_preempted: int

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_batches: int = 1,
        run_ahead: bool = False,
        proposer: NgramProposer | None = None,
        spec_token_budget: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.num_batches = num_batches  # batches in flight at once (the pipeline depth)
        # async scheduling: a decoding sequence may be scheduled again while its previous step runs;
        # the worker feeds it the token it sampled itself (single pipeline stage only)
        self.run_ahead = run_ahead
        self.proposer = proposer  # speculative decoding: drafts for decoding sequences (never with run_ahead)
        self.spec_token_budget = spec_token_budget  # see _drafts_per_seq; 0: no limit
        assert not (run_ahead and proposer), (
            "a step with drafts must be verified before the next is scheduled"
        )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._dropped: list[int] = []  # worker state to drop, sent with the next step
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_in_flight(self) -> int:
        return sum(1 for s in self.running if s.in_flight)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Frees a finished or aborted sequence that is not in flight."""
        assert not seq.in_flight
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free_seq(seq)
        self._forget_on_workers(seq)
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)

    @classmethod
    def from_config(cls, config: EngineConfig, num_blocks: int, max_model_len: int) -> Scheduler:
        """The engine's scheduler over the KV blocks the workers reported; ConfigError when one
        sequence of max_model_len would not fit them."""
        needed = -(-max_model_len // config.block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"KV cache holds {num_blocks} blocks of {config.block_size} tokens, but one sequence "
                f"of max_model_len={max_model_len} needs {needed}: raise the KV memory or "
                "lower max_model_len"
            )
        proposer = None
        if config.num_speculative_tokens:
            proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        return cls(
            BlockManager(num_blocks, config.block_size, config.enable_prefix_caching),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            num_batches=config.pipeline_parallel_size,
            run_ahead=config.run_ahead,
            proposer=proposer,
            spec_token_budget=config.spec_token_budget,
        )

    def unschedule(self, item: ScheduledSeq) -> None:
        """Undoes what schedule() counted in flight for a scheduled sequence that was never sent."""
        seq, num, samples = item
        seq.num_inflight_steps -= 1
        seq.num_inflight_tokens -= num
        seq.num_pending_samples -= samples

    def requeue_dropped(self, seq_ids: list[int]) -> None:
        """Drops taken by a step that was not sent after all: they ride on the next one."""
        self._dropped[:0] = seq_ids

    def schedule(self) -> SchedulerOutput:
        budget = -(-self.max_num_batched_tokens // self.num_batches)  # see the module docstring
        scheduled: list[ScheduledSeq] = []
        preempted = 0
        bm = self.block_manager
        max_seqs = self._batch_seq_limit()
        drafts_per_seq = self._drafts_per_seq(min(len(self.running), max_seqs))

        # 1. running sequences, oldest first: a decode token each, or the next chunk of their prompt
        for seq in list(self.running):
            if budget == 0 or len(scheduled) == max_seqs:
                break
            if seq.status != SequenceStatus.RUNNING or seq.finish_reason is not None or seq.aborted:
                continue
            if seq.in_flight and not self._may_run_ahead(seq):
                continue
            num = min(seq.num_uncomputed_tokens, budget)
            if num == 0:
                continue
            seq.draft_token_ids = (
                self._drafts(seq, budget, drafts_per_seq) if num == 1 and seq.on_workers else []
            )
            num += len(seq.draft_token_ids)
            fits = True
            while fits and not bm.allocate(seq, seq.num_computed_tokens + seq.num_inflight_tokens + num):
                victim = self._preemption_victim(scheduled)
                if victim is None:  # everything else is in flight: wait for their blocks
                    fits = False
                    break
                self._preempt(victim)
                preempted += 1
                fits = victim is not seq
            if not fits:
                seq.draft_token_ids = []
                continue
            scheduled.append(self._scheduled(seq, num))
            budget -= num
            # shareable as soon as scheduled, even by the waiting sequences below (see register_full_blocks)
            bm.register_full_blocks(seq, seq.num_computed_tokens + seq.num_inflight_tokens + num)

        # 2. waiting sequences, first come first served, while nothing had to be preempted
        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.max_num_seqs
            and len(scheduled) < max_seqs
        ):
            seq = self.waiting[0]
            bm.match_prefix(seq)
            num = min(seq.num_uncomputed_tokens, budget)
            if not bm.allocate(seq, seq.num_computed_tokens + num):
                # NOTE: a waiting sequence must not hold blocks, or the queue can deadlock with every
                # block pinned by prefix hits of sequences that cannot start. The hashes stay cached.
                bm.free_seq(seq)
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, num))
            budget -= num
            bm.register_full_blocks(seq, seq.num_computed_tokens + num)

        for seq, num, samples in scheduled:
            seq.num_inflight_steps += 1
            seq.num_inflight_tokens += num
            seq.num_pending_samples += samples
        dropped: list[int] = []
        if scheduled:  # drops ride on the next step that is actually sent
            dropped, self._dropped = self._dropped, []
        return SchedulerOutput(scheduled, dropped, preempted)

    @staticmethod
    def _scheduled(seq: Sequence, num: int) -> ScheduledSeq:
        # it samples when its tokens (drafts aside: they are not its tokens yet) reach its end
        return ScheduledSeq(seq, num, num - len(seq.draft_token_ids) == seq.num_uncomputed_tokens)

    def _drafts_per_seq(self, num_seqs: int) -> int:
        """Drafts a decoding sequence may get this step: num_speculative_tokens, or fewer where the
        step's rows (one per sequence plus the drafts) would pass spec_token_budget. Verifying a draft
        costs a row of every GEMM; where the batch already keeps the GEMMs compute-bound, the steps a
        draft saves (weight and K/V reads) no longer pay for it."""
        if self.proposer is None:
            return 0
        if not self.spec_token_budget:
            return self.proposer.k
        return min(self.proposer.k, max(0, self.spec_token_budget - num_seqs) // max(num_seqs, 1))

    def _drafts(self, seq: Sequence, budget: int, per_seq: int) -> list[int]:
        """Draft tokens for a decoding sequence: none past max_tokens or max_model_len (the step samples
        one token more than it has drafts) or past this batch's token budget."""
        if not per_seq or self.proposer is None or seq.grammar is not None or not self.proposer.eligible(seq):
            return []  # a grammar's mask holds for the next token only: no drafts to verify past it
        limit = min(budget, seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return self.proposer.propose(seq, min(limit, per_seq))

    def _may_run_ahead(self, seq: Sequence) -> bool:
        """A sequence in flight may be scheduled again for the token its running step samples, if that
        token cannot be its last by length (no step for a token past the end), or, while a chunk of its
        prompt that samples nothing runs, for the next chunk: those tokens are known already, and the
        worker runs steps in order, so the chunk attends over the one before. Without the second, a long
        prompt's chunks went out every other step, each gap filled by a smaller batch."""
        if not self.run_ahead or seq.grammar is not None or seq.num_inflight_steps != 1:
            return False  # (a grammar's next mask needs the token this step samples)
        if seq.num_pending_samples == 0:
            return seq.num_uncomputed_tokens > 0
        return (
            seq.num_pending_samples == 1
            and seq.num_output_tokens + 1 < seq.max_tokens
            and seq.num_tokens + 1 < self.max_model_len
        )

    def _batch_seq_limit(self) -> int:
        """Sequences one batch may hold: all of them, or with P batches in flight a 1/P share."""
        if self.num_batches == 1:
            return self.max_num_seqs
        active = min(len(self.running) + len(self.waiting), self.max_num_seqs)
        return max(1, -(-active // self.num_batches))

    def _preemption_victim(self, scheduled: list[ScheduledSeq]) -> Sequence | None:
        """The newest running sequence that is neither in flight nor already in this batch."""
        taken = {s.seq.seq_id for s in scheduled}
        for seq in reversed(self.running):
            if not seq.in_flight and seq.seq_id not in taken:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, requeue at the front; prefix caching makes the redo cheap."""
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._forget_on_workers(seq)
        self.num_preemptions += 1

    def _forget_on_workers(self, seq: Sequence) -> None:
        if seq.workers is not None:
            self._dropped.append(seq.seq_id)
            seq.workers = None

    def on_step_done(self, seq: Sequence, num_tokens: int, samples: bool, num_rejected: int = 0) -> None:
        """The KV of `num_tokens` more tokens of seq is now in the cache, of which the last `num_rejected`
        (drafts the model disagreed with) do not count."""
        seq.num_inflight_steps -= 1
        seq.num_inflight_tokens -= num_tokens
        seq.num_pending_samples -= samples
        seq.num_computed_tokens += num_tokens - num_rejected
        self.block_manager.register_computed(seq)
