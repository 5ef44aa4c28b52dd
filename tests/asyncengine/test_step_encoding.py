"""The step message as a pair: the engine's StepEncoder writes it, the worker's InputBatch applies it.

A random workload (chunked prompts, preemption on a small KV cache, n-gram drafts with random accepts,
async scheduling with two steps in flight) runs through the real Scheduler, the encoder, the msgpack
codec and InputBatch, with sampling simulated; after every update the worker's copy of each sequence
must equal the engine's (tokens, blocks, computed count), counting what is in flight.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from asyncengine.block_manager import BlockManager
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import Scheduler, SchedulerOutput
from asyncengine.sequence import Sequence
from asyncengine.spec_decode import NgramProposer, accept_drafts
from asyncengine.step_encoder import StepEncoder
from asyncengine.transport.codec import engine_codec
from asyncengine.worker.input_batch import InputBatch

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("mode", ["spec_decode", "run_ahead"])
@pytest.mark.parametrize("seed", range(4))
def test_workers_mirror_the_engine(mode: str, seed: int) -> None:
    import torch

    rng = random.Random(seed)
    run_ahead = mode == "run_ahead"
    proposer = None if run_ahead else NgramProposer(3, 1, 3)
    scheduler = Scheduler(
        BlockManager(24, 4, enable_prefix_caching=True),
        max_num_seqs=6,
        max_num_batched_tokens=24,
        max_model_len=64,
        run_ahead=run_ahead,
        proposer=proposer,
    )
    encoder = StepEncoder({0}, run_ahead)
    codec = engine_codec()
    workers = InputBatch(torch.device("cpu"))
    seqs: list[Sequence] = []
    for i in range(12):
        prompt = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 30))]  # few ids: n-grams repeat
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20), ignore_eos=True)
        seqs.append(Sequence(i, 0, prompt, params, params.max_tokens, i))
        scheduler.add(seqs[-1])
    in_flight: deque[SchedulerOutput] = deque()
    sampled_on_workers: dict[int, list[int]] = {}  # run-ahead: tokens the workers appended, not yet processed
    checked = drafted = 0
    for step_id in range(2000):
        if not scheduler.has_unfinished:
            break
        sched = scheduler.schedule() if len(in_flight) < (2 if run_ahead else 1) else None
        if sched is not None and sched.scheduled:
            step = encoder.encode(step_id, sched)
            batch = workers.update(codec.decode(codec.encode(step.request)))
            for (seq, num, _samples), state in zip(step.items, batch.seqs):
                pending = sampled_on_workers.get(seq.seq_id, [])
                assert state.token_ids == seq.token_ids + pending + seq.draft_token_ids
                assert state.block_ids == seq.block_ids[: len(state.block_ids)]
                assert len(state.block_ids) == len(seq.block_ids)
                # the workers have computed what earlier steps in flight carry; the engine counts it on
                # their return
                assert state.num_computed_tokens == seq.num_computed_tokens + seq.num_inflight_tokens - num
                checked += 1
            workers.mark_computed(batch)
            for (seq, _num, samples), state in zip(step.items, batch.seqs):
                if samples and run_ahead:  # the worker appends what it samples, as worker.py does
                    token = rng.randrange(1, 6)
                    state.append([token])
                    sampled_on_workers.setdefault(seq.seq_id, []).append(token)
            in_flight.append(sched._replace(scheduled=step.items))
            continue
        assert in_flight, "nothing scheduled and nothing in flight"
        done = in_flight.popleft()
        for seq, num, samples in done.scheduled:
            drafts, seq.draft_token_ids = seq.draft_token_ids, []
            drafted += len(drafts)
            if not samples:
                scheduler.on_step_done(seq, num, False)
                continue
            if run_ahead:
                sampled = [sampled_on_workers[seq.seq_id].pop(0)]
            else:  # the model agrees with a random prefix of the drafts
                keep = rng.randrange(len(drafts) + 1)
                sampled = drafts[:keep] + [rng.randrange(1, 6) for _ in range(len(drafts) + 1 - keep)]
            accepted = accept_drafts(drafts, sampled)
            if drafts:
                encoder.on_drafts_verified(seq, len(drafts), accepted)
            scheduler.on_step_done(seq, num, True, len(drafts) - accepted)
            if seq.is_finished or seq.finish_reason:
                continue
            for token in sampled[: accepted + 1]:
                seq.token_ids.append(token)
                if seq.num_output_tokens >= seq.max_tokens:
                    seq.finish_reason = "length"
                    break
            if seq.finish_reason and not seq.in_flight:
                scheduler.finish(seq)
        for seq in seqs:  # finished while another step of theirs was in flight
            if seq.finish_reason and not seq.in_flight and not seq.is_finished:
                scheduler.finish(seq)
    assert not scheduler.has_unfinished and checked > 50
    print(f"{mode} seed {seed}: {checked} checks, {scheduler.num_preemptions} preemptions, {drafted} drafts")
    assert scheduler.num_preemptions > 0 and (run_ahead or drafted > 0)
    assert all(s.num_output_tokens == s.max_tokens for s in seqs)
    if proposer is not None:
        assert not proposer.indexes  # forgotten with their sequences
