"""BlockManager and Scheduler without workers: reference counts, prefix caching, budgets, preemption."""

from __future__ import annotations

from asyncengine.block_manager import BlockManager
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import Scheduler
from asyncengine.sequence import Sequence, SequenceStatus

_ids = iter(range(10**9))


def seq(tokens: list[int], max_tokens: int = 8) -> Sequence:
    n = next(_ids)
    return Sequence(n, 0, tokens, SamplingParams(max_tokens=max_tokens), max_tokens, n)


def finish_step(sched: Scheduler, out) -> None:
    for s, num, samples in out.scheduled:
        sched.on_step_done(s, num, samples)
        if samples:
            s.token_ids.append(7)


def test_prefix_cache_hit_shares_blocks_and_refcounts() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(list(range(10)))
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.register_computed(a)  # two full blocks are now cached
    b = seq(list(range(8)) + [99, 98, 97])
    bm.match_prefix(b)
    assert b.num_computed_tokens == 8 and b.block_ids == a.block_ids[:2]
    assert bm.ref_counts[a.block_ids[0]] == 2
    bm.free_seq(a)
    assert bm.ref_counts[b.block_ids[0]] == 1
    bm.free_seq(b)
    assert bm.num_free_blocks == 10
    # freed blocks keep their hash until evicted, so the prefix is still found
    c = seq(list(range(9)))
    bm.match_prefix(c)
    assert c.num_computed_tokens == 8


def test_prefix_match_always_leaves_a_token_to_compute() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(8)))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.register_computed(a)
    b = seq(list(range(8)))
    bm.match_prefix(b)
    assert b.num_computed_tokens == 4  # the last block is recomputed to get logits


def test_eviction_reuses_lru_cached_blocks() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq(list(range(8)))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.register_computed(a)
    bm.free_seq(a)
    b = seq([50] * 8)
    assert bm.allocate(b, 8)  # evicts both cached blocks
    assert not bm.cached or all(bm.block_hash[i] is None for i in b.block_ids)
    c = seq(list(range(8)))
    bm.match_prefix(c)
    assert c.num_computed_tokens == 0


def test_blocks_without_a_hash_are_reused_before_cached_ones_are_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(10)))  # two full blocks (cached) and a partial one
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.register_computed(a)
    partial = a.block_ids[2]
    bm.free_seq(a)
    b = seq([50] * 3)
    assert bm.allocate(b, 3) and b.block_ids == [partial]  # the hashless block first, not a fresh one
    c = seq([60] * 3)
    assert bm.allocate(c, 3) and bm.block_hash[c.block_ids[0]] is None  # then the never-used block
    d = seq(list(range(9)))
    bm.match_prefix(d)
    assert d.num_computed_tokens == 8  # the cached prefix survived both allocations

    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    e = seq(list(range(8)))
    bm.allocate(e, 8)
    used = list(e.block_ids)
    bm.free_seq(e)
    f = seq(list(range(8)))
    bm.allocate(f, 8)
    assert sorted(f.block_ids) == sorted(used)  # without prefix caching: the same, touched blocks again


def test_scheduler_budget_chunks_prompts() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=256)
    long, short = seq(list(range(25))), seq([1, 2, 3])
    sched.add(long)
    sched.add(short)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n, _ in out.scheduled] == [(long.seq_id, 10)]
    finish_step(sched, out)
    out = sched.schedule()
    assert [n for _, n, _ in out.scheduled] == [10]
    finish_step(sched, out)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n, _ in out.scheduled] == [(long.seq_id, 5), (short.seq_id, 3)]


def test_scheduler_preempts_newest_and_keeps_in_flight() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=16)
    a, b = seq(list(range(4))), seq(list(range(10, 14)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert len(out.scheduled) == 2
    finish_step(sched, out)
    # at 9 tokens each needs a third block: 6 > 4, so b (the newest) is preempted
    for _ in range(6):
        out = sched.schedule()
        finish_step(sched, out)
    assert sched.num_preemptions >= 1
    assert b.status == SequenceStatus.WAITING or b.num_computed_tokens < b.num_tokens
    assert a.status == SequenceStatus.RUNNING


def test_in_flight_sequences_are_not_rescheduled() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    a = seq([1, 2, 3])
    sched.add(a)
    first = sched.schedule()
    assert len(first.scheduled) == 1
    assert sched.schedule().scheduled == []  # a is in flight: nothing else to do
    finish_step(sched, first)
    assert len(sched.schedule().scheduled) == 1


def test_waiting_sequence_that_cannot_start_holds_no_blocks() -> None:
    # regression: a head-of-queue prefix hit that then failed to allocate kept its blocks pinned
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=24)
    a = seq(list(range(16)))
    sched.add(a)
    finish_step(sched, sched.schedule())  # a holds 5 blocks, 4 of them cached full blocks
    b = seq(list(range(16)) + [99] * 6)  # same prefix, needs 6 blocks: cannot start while a runs
    sched.add(b)
    out = sched.schedule()
    assert [s.seq_id for s, *_ in out.scheduled] == [a.seq_id]
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert all(bm.ref_counts[i] == 1 for i in a.block_ids)


def test_run_ahead_schedules_a_decoding_sequence_before_its_token_is_known() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, run_ahead=True)
    a = seq([1, 2, 3], max_tokens=3)
    sched.add(a)
    first = sched.schedule()
    assert [(n, samples) for _, n, samples in first.scheduled] == [(3, True)]
    ahead = sched.schedule()  # a is in flight, decoding: its next step goes out at once
    assert [(s.seq_id, n, samples) for s, n, samples in ahead.scheduled] == [(a.seq_id, 1, True)]
    assert sched.schedule().scheduled == []  # never two steps ahead
    finish_step(sched, first)
    finish_step(sched, ahead)
    third = sched.schedule()  # the token of the third step would be the last (max_tokens=3) ...
    assert [n for _, n, _ in third.scheduled] == [1]
    assert sched.schedule().scheduled == []  # ... so nothing runs ahead of it


def test_run_ahead_sends_a_prompts_next_chunk_while_the_last_one_runs() -> None:
    """A chunk of a prompt samples nothing and the next chunk's tokens are known: it goes out in the next
    step at once, not every other step; the last chunk samples, and the decode token runs ahead of it."""
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64, run_ahead=True)
    a = seq(list(range(10)), max_tokens=4)
    sched.add(a)
    steps = [sched.schedule() for _ in range(2)]
    assert [[(n, s) for _, n, s in out.scheduled] for out in steps] == [[(4, False)], [(4, False)]]
    assert sched.schedule().scheduled == []  # never two steps ahead
    finish_step(sched, steps[0])
    last = sched.schedule()  # the prompt's last 2 tokens: it samples
    assert [(n, samples) for _, n, samples in last.scheduled] == [(2, True)]
    finish_step(sched, steps[1])
    decode = sched.schedule()  # runs ahead of the token the last chunk samples
    assert [(n, samples) for _, n, samples in decode.scheduled] == [(1, True)]
    finish_step(sched, last)
    finish_step(sched, decode)
    assert a.num_computed_tokens == 11 and a.num_output_tokens == 2
    assert len(a.block_ids) == 3  # 12 tokens of 4 a block
