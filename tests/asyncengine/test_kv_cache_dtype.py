"""kv_cache_dtype=fp8_e5m2: a float8 KV cache on CPU workers, half the bytes of bfloat16 per block."""

from __future__ import annotations

import random

import pytest
import torch

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import ParallelContext
from asyncengine.worker.model_runner import ModelRunner


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fp8_cache_kernel_and_reference_agree(arch, tiny_model_factory, llm_factory) -> None:
    """The C kernel and the PyTorch reference read the same rounded K/V: same greedy tokens, with
    chunked prefill and prefix hits over the float8 blocks too."""
    model = tiny_model_factory(arch)
    rng = random.Random(0)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 30, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = []
    for backend in ("cpu", "torch"):
        llm = llm_factory(
            model, kv_cache_dtype="fp8_e5m2", attention_backend=backend, max_num_batched_tokens=48
        )
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.shutdown()
    assert outs[0] == outs[1]
    assert all(len(t) == 10 for t in outs[0])


def test_fp8_cache_halves_the_block_bytes(tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    runners = [
        ModelRunner(
            EngineConfig(model=str(model), kv_cache_dtype=kv),
            ParallelContext(),
            torch.device("cpu"),
            torch.bfloat16,
            256,
        )
        for kv in ("auto", "fp8_e5m2")
    ]
    assert runners[0].kv_bytes_per_block == 2 * runners[1].kv_bytes_per_block
    runners[1].init_cache(4)
    assert all(k.dtype == v.dtype == torch.float8_e5m2 for k, v in runners[1].kv_caches)


def test_bad_kv_cache_dtype_is_a_config_error(tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(model=str(model), kv_cache_dtype="int4")


@pytest.mark.slow
@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2)])
def test_fp8_cache_sharded_matches_single_worker(pp, tp, tiny_model_factory, llm_factory) -> None:
    """Each stage / TP rank keeps its own float8 cache of its layers / KV heads: same greedy tokens."""
    model = tiny_model_factory("llama", num_hidden_layers=4)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 120))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = []
    for p, t in ((1, 1), (pp, tp)):
        llm = llm_factory(
            model, kv_cache_dtype="fp8_e5m2", pipeline_parallel_size=p, tensor_parallel_size=t, num_threads=1
        )
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.shutdown()
    assert outs[0] == outs[1]


def test_fp8_cache_write_without_the_c_op() -> None:
    """The index_copy_ path (GPUs, or ASYNCENGINE_CPU_OPS=0) writes float8 K/V as bytes, like the C copy."""
    from asyncengine.cpu import ops as cpu_ops
    from asyncengine.layers.attention import write_kv_cache

    e5m2 = torch.float8_e5m2
    k, v = torch.randn(5, 2, 8).to(e5m2), torch.randn(5, 2, 8).to(e5m2)
    slots = torch.tensor([3, 17, 0, 9, 30])
    caches = []
    for use_c in (True, False):
        kc, vc = torch.zeros(4, 8, 2, 8, dtype=e5m2), torch.zeros(4, 8, 2, 8, dtype=e5m2)
        if use_c:
            write_kv_cache(k, v, kc, vc, slots)
        else:
            with cpu_ops.disabled():
                write_kv_cache(k, v, kc, vc, slots)
        caches.append((kc.view(torch.uint8), vc.view(torch.uint8)))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[1][0].view(e5m2).view(-1, 2, 8)[slots].view(torch.uint8), k.view(torch.uint8))
