"""Regression: a step mixing new and cached sequences maps each sampled token to its own sequence."""

from __future__ import annotations

import pytest
from tiny_models import hf_greedy

from asyncengine import SamplingParams

pytestmark = pytest.mark.timeout(180)


def test_tokens_map_to_their_sequences_in_mixed_steps(tiny_model_factory, llm_factory) -> None:
    model = tiny_model_factory("llama")
    # a decoding sequence (cached on the workers) shares steps with newly admitted ones (sent whole)
    prompts = [[5, 6, 7], [9] * 40, [11, 12], [13] * 20]
    expected = hf_greedy(model, prompts, 10)
    llm = llm_factory(model, max_num_batched_tokens=8, max_num_seqs=4)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == expected
