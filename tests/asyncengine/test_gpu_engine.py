"""The whole engine on a GPU: CUDA graphs + Triton attention give HF's greedy tokens (float32)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import hf_greedy

from asyncengine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_greedy_matches_hf(arch, enforce_eager, tiny_model_factory) -> None:
    model = tiny_model_factory(arch)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 33, 100)]
    expected = hf_greedy(model, prompts, 12)
    llm = LLM(
        model=str(model), device="cuda", dtype="float32", num_kv_blocks=128, enforce_eager=enforce_eager
    )
    try:
        got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in got] == expected
    finally:
        llm.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_pipeline_two_gpus(tiny_model_factory) -> None:
    model = tiny_model_factory("llama", num_hidden_layers=4)
    prompts = [[5, 6, 7, 8], list(range(10, 50))]
    expected = hf_greedy(model, prompts, 8)
    llm = LLM(model=str(model), device="cuda", dtype="float32", num_kv_blocks=128, pipeline_parallel_size=2)
    try:
        got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in got] == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_fp8_cache_triton_matches_reference(enforce_eager, tiny_model_factory) -> None:
    """kv_cache_dtype=fp8_e5m2 on a GPU: the Triton kernels (with CUDA graphs or eager) and the torch
    reference read the same float8 K/V, so they give the same greedy tokens."""
    model = tiny_model_factory("llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 33, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for backend in ("triton", "torch"):
        llm = LLM(
            model=str(model),
            device="cuda",
            dtype="float32",
            num_kv_blocks=128,
            kv_cache_dtype="fp8_e5m2",
            attention_backend=backend,
            enforce_eager=enforce_eager,
        )
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]
