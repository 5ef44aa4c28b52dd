"""Greedy output equals HF transformers token for token, for every architecture and scheduling regime."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import ARCHITECTURES, hf_greedy, load_hf

from asyncengine import SamplingParams

PROMPT_LENGTHS = (1, 5, 16, 17, 40, 64, 100, 151, 250)
MAX_NEW = 12


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_hf(arch, tiny_model_factory, llm_factory) -> None:
    model = tiny_model_factory(arch)
    prompts = make_prompts(512)
    expected = hf_greedy(model, prompts, MAX_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

    # all prompts at once, default scheduling
    llm = llm_factory(model)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    llm.shutdown()

    # a tiny token budget forces chunked prefill; a tiny KV cache forces preemption by recompute
    llm = llm_factory(model, max_num_batched_tokens=24, num_kv_blocks=22, max_model_len=300, block_size=16)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == 22


SLIDING = {
    # Mistral: a window on every layer; 20 is not a multiple of the 16-token block, so windows start mid-block
    "mistral": dict(sliding_window=20),
    # Qwen2/3: the window only on the layers from max_window_layers on ("sliding_attention")
    "qwen2": dict(use_sliding_window=True, sliding_window=33, max_window_layers=1, num_hidden_layers=3),
    "qwen3": dict(use_sliding_window=True, sliding_window=7, max_window_layers=1, num_hidden_layers=2),
}


@pytest.mark.parametrize("arch", list(SLIDING))
def test_sliding_window_matches_hf(arch, tiny_model_factory, llm_factory) -> None:
    """Prompts and outputs longer than the window: each query sees only the last W keys, as in HF, in
    decode (the C kernel), prompt chunks after cached context (SDPA with a mask), a multi-row kernel
    chunk and speculative draft rows."""
    model = tiny_model_factory(arch, **SLIDING[arch])
    prompts = make_prompts(512, seed=3)
    expected = hf_greedy(model, prompts, 30)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for kwargs in ({}, {"max_num_batched_tokens": 24, "block_size": 16}, {"num_speculative_tokens": 3}):
        llm = llm_factory(model, **kwargs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected, kwargs
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prefix_caching_reuses_blocks_and_stays_exact(arch, tiny_model_factory, llm_factory) -> None:
    model = tiny_model_factory(arch)
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(70)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 30)]
    expected = hf_greedy(model, prompts, MAX_NEW)
    llm = llm_factory(model, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert llm.engine.scheduler.block_manager.prefix_hits >= 2 * 64  # 4 full shared blocks, twice


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("pp", [1, 2])
def test_a_burst_with_a_common_prefix_computes_it_once(arch, pp, tiny_model_factory, llm_factory) -> None:
    """Requests submitted together share the prefix blocks that the first of them is still computing
    (in the same step, or in a step in flight before theirs) and still match HF token for token."""
    model = tiny_model_factory(arch)
    rng = random.Random(2)
    shared = [rng.randrange(3, 512) for _ in range(100)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 20, 1, 40, 7, 16)]
    expected = hf_greedy(model, prompts, MAX_NEW)
    llm = llm_factory(model, block_size=16, pipeline_parallel_size=pp, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    # 6 full shared blocks: every request after the first (5 of them) found them
    assert llm.engine.scheduler.block_manager.prefix_hits >= 5 * 96


def test_logprobs_match_hf_log_softmax(tiny_model_factory, llm_factory) -> None:
    model = tiny_model_factory("llama")
    prompt = list(range(5, 30))
    llm = llm_factory(model)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5))[
        0
    ]
    completion = out.outputs[0]
    hf = load_hf(model)
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        ref = hf(ids).logits[0].log_softmax(-1)  # [L, V]
    total = 0.0
    for step, (token, lps) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert abs(lps[token].logprob - row[token].item()) < 1e-4
        assert lps[token].rank == 1  # greedy picks the top token
        top = row.topk(5)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(lps[t].logprob - v) < 1e-4
        total += row[token].item()
    assert abs(completion.cumulative_logprob - total) < 1e-3


def test_llama_with_a_sliding_window_key_matches_hf_generate(tiny_model_factory, llm_factory) -> None:
    """HF's Llama has no window in its attention mask, but `generate` builds its cache from the config
    and keeps only a window of keys per layer when config.json carries `sliding_window`: decode steps
    are windowed. The window applies here too, so outputs that run past it match (prompts within it)."""
    model = tiny_model_factory("llama", sliding_window=24)
    prompts = [p for p in make_prompts(512, seed=4) if len(p) <= 24]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm_factory(model).generate(prompts, params)]
    assert got == hf_greedy(model, prompts, 40)
