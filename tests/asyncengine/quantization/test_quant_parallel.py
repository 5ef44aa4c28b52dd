"""Quantized checkpoints under tensor and pipeline parallelism equal the single-process run token for
token: act-order groups cut by row-parallel shards (hidden 96 and intermediate 160 over two ranks), and
int8 and int4 quantized at load time from each rank's full tensors (int4's groups of 32 cut by the
row-parallel halves 48 and 80)."""

from __future__ import annotations

import random

import pytest
from conftest import ODD_SHAPES
from quant_writer import Spec, load_time_method

from asyncengine import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


@pytest.mark.parametrize(
    ("arch", "spec"),
    [
        ("llama", Spec("gptq", 4, 64, sym=False, desc_act=True)),
        ("llama", None),
        ("gpt2", None),  # int8 of a fused c_attn: each rank's q, k and v rows
        ("llama", "int4"),
    ],
    ids=["gptq4-asym-actorder", "int8", "gpt2-int8", "int4"],
)
def test_parallel_quantized_equals_single_process(arch, spec, quantized_factory, llm_factory) -> None:
    quantized, _ = quantized_factory(arch, spec, **ODD_SHAPES)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    common = dict(
        quantization=load_time_method(spec),
        num_threads=1,
        num_kv_blocks=64,
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=16,
    )
    single = llm_factory(quantized, **common)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    single.shutdown()
    for layout in LAYOUTS.values():
        llm = llm_factory(quantized, **common, **layout)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected, layout
        llm.shutdown()
