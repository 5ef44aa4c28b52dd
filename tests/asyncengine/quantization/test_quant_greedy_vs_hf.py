"""End to end: greedy output of quantized checkpoints equals HF transformers running the same model with
the dequantized weights in float32, token for token; in bfloat16 the log-probabilities stay within a
stated tolerance of that oracle."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import ODD_SHAPES
from quant_writer import Spec, load_time_method
from tiny_models import hf_greedy, load_hf

from asyncengine import SamplingParams

pytestmark = pytest.mark.timeout(180)

PROMPT_LENGTHS = (1, 6, 17, 40, 70)
MAX_NEW = 10
# bfloat16 activations against the float32 oracle: the largest difference of a chosen token's
# log-probability, measured 0.002 on this model (bfloat16 keeps 8 bits of mantissa)
BF16_LOGPROB_TOL = 0.02

CASES = {
    "llama-gptq4-g64-asym-actorder": ("llama", Spec("gptq", 4, 64, sym=False, desc_act=True)),
    "llama-fp8-channel": ("llama", Spec("fp8", fp8_scale="channel")),
    "qwen2-awq-g64": ("qwen2", Spec("awq", 4, 64)),
    "qwen2-int8": ("qwen2", None),
    "qwen3-gptq8-g32-v2": ("qwen3", Spec("gptq_v2", 8, 32)),
    "qwen3-ct-w4a16-g32": ("qwen3", Spec("compressed", 4, 32)),
    "mistral-gptq4-g32": ("mistral", Spec("gptq", 4, 32)),
    "gpt2-int8": ("gpt2", None),  # a fused c_attn, cut into q, k and v after quantizing its rows
    "llama-int4": ("llama", "int4"),  # --quantization int4: groups of 32 over hidden 96 / intermediate 160
    "qwen2-int4": ("qwen2", "int4"),
    "qwen3-int4": ("qwen3", "int4"),
    "gpt2-int4": ("gpt2", "int4"),
}


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_greedy_matches_hf_on_dequantized_weights(case, quantized_factory, llm_factory) -> None:
    arch, spec = CASES[case]
    quantized, oracle = quantized_factory(arch, spec, **ODD_SHAPES)
    prompts = make_prompts()
    expected = hf_greedy(oracle, prompts, MAX_NEW)
    # a 24-token budget chunks the longer prompts: prefill and decode both run the quantized GEMMs
    llm = llm_factory(quantized, quantization=load_time_method(spec), max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


def test_bfloat16_logprobs_within_tolerance_of_the_oracle(quantized_factory, llm_factory) -> None:
    quantized, oracle = quantized_factory("llama", CASES["llama-gptq4-g64-asym-actorder"][1], **ODD_SHAPES)
    prompt = make_prompts(1)[3]
    llm = llm_factory(quantized, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    completion = llm.generate([prompt], params)[0].outputs[0]
    with torch.no_grad():
        ref = load_hf(oracle)(torch.tensor([prompt + completion.token_ids])).logits[0].log_softmax(-1)
    worst = 0.0
    for step, (token, lps) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + step]
        worst = max(worst, abs(lps[token].logprob - row[token].item()))
    assert worst < BF16_LOGPROB_TOL
