"""Speculative decoding with n-gram prompt lookup: the drafts it proposes, and output that stays the
model's greedy output (HF transformers) whatever the drafts, the batch, the budget or the stops."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import ARCHITECTURES, hf_greedy

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.sampling_params import OutputKind
from asyncengine.spec_decode import NgramIndex
from asyncengine.transport.wire import CachedSeq, ExecuteModelRequest, NewSeq, SamplingOptions, pack_ids
from asyncengine.worker.input_batch import InputBatch

MAX_NEW = 24


def brute_force(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest matching tail."""
    length = len(token_ids)
    for n in range(min(n_max, length), n_min - 1, -1):
        tail = token_ids[-n:]
        for s in range(length - n - 1, -1, -1):
            if token_ids[s : s + n] == tail:
                return token_ids[s + n : s + n + k]
    return []


def test_ngram_lookup() -> None:
    index = NgramIndex(1, 3)
    assert index.lookup([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert NgramIndex(1, 3).lookup([5, 9, 5, 7, 5], 4) == [7, 5]  # the most recent occurrence wins
    assert NgramIndex(1, 3).lookup([1, 2, 3], 2) == []  # nothing repeats
    assert NgramIndex(2, 3).lookup([8, 1, 2, 7, 2], 2) == []  # only 1-grams would match
    assert NgramIndex(1, 3).lookup([4, 6, 8, 1, 6], 5) == [8, 1, 6]  # falls back to n = 1, ends at the tail


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 3), (2, 4)])
def test_incremental_index_matches_brute_force(n_min, n_max) -> None:
    rng = random.Random(n_max)
    for _ in range(30):
        index = NgramIndex(n_min, n_max)
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        for _ in range(40):  # grow the sequence between lookups, as decoding does (1 or more tokens a step)
            k = rng.randrange(1, 6)
            assert index.lookup(tokens, k) == brute_force(tokens, k, n_min, n_max), tokens
            tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


def test_config_checks(tiny_model_factory) -> None:
    model = str(tiny_model_factory("llama"))
    with pytest.raises(ConfigError):
        EngineConfig(model=model, num_speculative_tokens=-1)
    with pytest.raises(ConfigError):
        EngineConfig(model=model, prompt_lookup_min=3, prompt_lookup_max=2)
    assert not EngineConfig(model=model, num_speculative_tokens=2).run_ahead
    assert EngineConfig(model=model).run_ahead


def make_prompts(vocab: int) -> list[list[int]]:
    """Random prompts, and prompts that repeat a phrase (their continuations get drafts from the start)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 40, 90)]
    for n, reps in ((3, 6), (11, 4), (30, 3)):
        phrase = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(phrase * reps + phrase[: n // 2])
    return prompts


def accepted(llm) -> tuple[float, float]:
    registry = llm.engine.stats.registry
    return (
        registry.get_sample_value("asyncengine:spec_decode_num_draft_tokens_total"),
        registry.get_sample_value("asyncengine:spec_decode_num_accepted_tokens_total"),
    )


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_speculative_greedy_matches_hf(arch, tiny_model_factory, llm_factory) -> None:
    model = tiny_model_factory(arch)
    prompts = make_prompts(512)
    expected = hf_greedy(model, prompts, MAX_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = llm_factory(model, num_speculative_tokens=4)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    drafts, kept = accepted(llm)
    assert drafts > 0 and kept > 0  # drafts were proposed and some were right (the repeated phrases)
    llm.shutdown()

    # chunked prefill, preemption by recompute (drafts dropped with the sequence) and a small budget
    # that caps the drafts of the sequences scheduled last
    llm = llm_factory(
        model,
        num_speculative_tokens=3,
        max_num_batched_tokens=24,
        num_kv_blocks=22,
        max_model_len=300,
        block_size=16,
    )
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == 22


def test_drafts_respect_lengths_stops_and_other_requests(tiny_model_factory, llm_factory) -> None:
    """max_tokens is met exactly even where a step could accept more drafts; a stop token inside the
    accepted drafts ends the output there; requests that get no drafts (sampling, logprobs, penalties,
    min_tokens) give what they give without speculation, in the same batches."""
    model = tiny_model_factory("llama")
    prompts = make_prompts(512)
    plain = llm_factory(model)
    spec = llm_factory(model, num_speculative_tokens=5)
    greedy = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 9, 13, 17, 30)
    ]
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    stop_at = reference[4][6]  # a token the model emits mid-way: ends the output at its first occurrence
    others = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
        SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(
            temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=6, stop_token_ids=[stop_at]
        ),
    ]
    batch_prompts = prompts + [prompts[4]] * len(others)
    params = greedy + others
    want = plain.generate(batch_prompts, params)
    got = spec.generate(batch_prompts, params)
    for w, g, p in zip(want, got, params):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert len(g.outputs[0].token_ids) <= p.max_tokens
    assert [len(o.outputs[0].token_ids) for o in got[: len(greedy)]] == [p.max_tokens for p in greedy]
    assert got[len(greedy)].outputs[0].token_ids[-1] == stop_at
    assert got[len(greedy)].outputs[0].finish_reason == "stop"
    lp_want, lp_got = want[len(greedy) + 2].outputs[0].logprobs, got[len(greedy) + 2].outputs[0].logprobs
    assert [sorted(d) for d in lp_got] == [sorted(d) for d in lp_want]
    assert accepted(spec)[1] > 0


def test_streaming_gets_every_accepted_token(tiny_model_factory, llm_factory) -> None:
    """A step may add several tokens: the stream's deltas still add up to the final output."""
    model = tiny_model_factory("llama")
    llm = llm_factory(model, num_speculative_tokens=4)
    prompt = make_prompts(512)[5]
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, output_kind=OutputKind.DELTA
    )

    async def collect() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) async for o in llm.engine.generate(prompt, params)]

    deltas = llm._call(collect())  # on the engine's own loop
    whole = [t for d in deltas for t in d]
    assert whole == hf_greedy(model, [prompt], MAX_NEW)[0]
    assert len(deltas) < MAX_NEW  # some steps brought more than one token


@pytest.mark.slow
def test_speculative_with_pipeline_and_tensor_parallel(tiny_model_factory, llm_factory) -> None:
    model = tiny_model_factory("llama")
    prompts = make_prompts(512)
    expected = hf_greedy(model, prompts, MAX_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for pp, tp in ((2, 1), (1, 2)):
        llm = llm_factory(model, num_speculative_tokens=3, pipeline_parallel_size=pp, tensor_parallel_size=tp)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        assert accepted(llm)[1] > 0
        llm.shutdown()


def test_token_budget_limits_drafts(tiny_model_factory, llm_factory) -> None:
    """spec_token_budget caps a step's rows: with as many rows as sequences there is no room for a draft,
    with twice as many there is one per sequence."""
    model = tiny_model_factory("llama")
    prompts = make_prompts(512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    expected = hf_greedy(model, prompts, MAX_NEW)
    none = llm_factory(model, num_speculative_tokens=4, spec_token_budget=len(prompts))
    assert [o.outputs[0].token_ids for o in none.generate(prompts, params)] == expected
    assert accepted(none) == (0.0, 0.0)
    sched = none.engine.scheduler
    assert [sched._drafts_per_seq(n) for n in (1, 4, 7, 8, 200)] == [4, 0, 0, 0, 0]
    sched.spec_token_budget = 16
    assert [sched._drafts_per_seq(n) for n in (1, 4, 7, 8, 9, 16)] == [4, 3, 1, 1, 0, 0]
    sched.spec_token_budget = 0  # no limit
    assert sched._drafts_per_seq(500) == 4


def test_worker_state_drops_rejected_drafts() -> None:
    """The worker's copy of a sequence: drafts arrive as tokens, the next step's diff drops the rejected
    ones (tokens, their output counts for penalties, their computed slots) before appending."""
    batch = InputBatch(torch.device("cpu"))
    opts = SamplingOptions(temperature=0.0)
    step = batch.update(ExecuteModelRequest(0, new_seqs=[NewSeq(7, pack_ids([1, 2, 3]), 3, [0], 0, 3, opts)]))
    batch.mark_computed(step)
    state = batch.seqs[7]
    # sampled 9; drafts 9, 4 (the step computes 9 and both drafts)
    step = batch.update(ExecuteModelRequest(1, cached_seqs=[CachedSeq(7, 3, [9, 9, 4], [], 0, 2)]))
    assert step.num_drafts == [2] and state.token_ids == [1, 2, 3, 9, 9, 4]
    batch.mark_computed(step)
    assert state.num_computed_tokens == 6
    # the model kept the first draft (9) and sampled 5 after it: drop 4, append 5
    step = batch.update(ExecuteModelRequest(2, cached_seqs=[CachedSeq(7, 1, [5], [], 1, 0)]))
    assert state.token_ids == [1, 2, 3, 9, 9, 5] and state.num_computed_tokens == 5
    assert state.output_counts == {9: 2, 5: 1}
    with pytest.raises(
        ValueError
    ):  # more rejected tokens than outputs: a corrupt diff, not a silent rollback
        batch.update(ExecuteModelRequest(3, cached_seqs=[CachedSeq(7, 1, [], [], 4, 0)]))
    with pytest.raises(ValueError):
        batch.update(ExecuteModelRequest(4, cached_seqs=[CachedSeq(7, 2, [1, 2], [], 0, 2)]))


def test_worker_penalty_state_drops_rejected_drafts() -> None:
    """A sequence with penalties keeps dense per-token arrays (layers/sampler.PenaltyState) that follow
    its drafts and rollbacks; one without keeps none."""
    batch = InputBatch(torch.device("cpu"), vocab_size=16)
    opts = SamplingOptions(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5)
    new = [
        NewSeq(7, pack_ids([1, 2, 3]), 3, [0], 0, 3, opts),
        NewSeq(8, pack_ids([1]), 1, [1], 0, 1, SamplingOptions()),
    ]
    batch.mark_computed(batch.update(ExecuteModelRequest(0, new_seqs=new)))
    assert batch.seqs[8].penalties is None
    state = batch.seqs[7]
    batch.mark_computed(
        batch.update(ExecuteModelRequest(1, cached_seqs=[CachedSeq(7, 3, [9, 9, 4], [], 0, 2)]))
    )
    batch.update(
        ExecuteModelRequest(2, cached_seqs=[CachedSeq(7, 1, [5], [], 1, 0)])
    )  # 4 rejected, 5 sampled
    assert state.token_ids == [1, 2, 3, 9, 9, 5]
    assert sorted(state.penalties.seen_ids.values.tolist()) == [1, 2, 3, 5, 9]
    pen = state.penalties
    assert dict(zip(pen.output_ids.values.tolist(), pen.counts.values.tolist())) == {9: 2.0, 5: 1.0}


def test_text_and_stop_strings_with_drafts(tiny_model_factory, llm_factory) -> None:
    """With a tokenizer: the text of a speculating request is the text without speculation, and a stop
    string completed by a token inside the accepted drafts cuts the text (and the tokens) there."""
    model = tiny_model_factory("llama", tokenizer=True)
    plain = llm_factory(model)
    spec = llm_factory(model, num_speculative_tokens=4)
    prompts = ["Hello", "def fibonacci(n):", "a b a b a b a b"]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert accepted(spec)[1] > 0
    for w in want:
        text = w.outputs[0].text
        if len(text) < 12:
            continue
        stop = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[text[8:11]])
        a, b = plain.generate(w.prompt, stop)[0].outputs[0], spec.generate(w.prompt, stop)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (
            a.text,
            a.token_ids,
            a.finish_reason,
            a.stop_reason,
        )
        assert b.finish_reason == "stop"
