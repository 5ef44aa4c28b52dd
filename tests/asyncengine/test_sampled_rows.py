"""The last decoder layer cut to the step's sampled rows (AttentionMetadata.sampled, SampledRows): the
hidden states the LM head reads are those of the full forward, on every attention backend, for prompt
chunks, chunks that sample nothing, chunks after cached context, drafts and decode rows mixed."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

from asyncengine.config import EngineConfig
from asyncengine.layers.attention import forward_context, set_attention_backend
from asyncengine.layers.attention_cpu import CpuAttentionBackend
from asyncengine.layers.attention_torch import TorchAttentionBackend
from asyncengine.layers.parallel import ParallelContext
from asyncengine.transport.wire import SamplingOptions
from asyncengine.worker.input_batch import SeqState, StepBatch
from asyncengine.worker.model_runner import ModelInput, ModelRunner

BLOCK = 16


def runner_for(path: Any, dtype: torch.dtype, backend: str) -> ModelRunner:
    set_attention_backend(CpuAttentionBackend() if backend == "cpu" else TorchAttentionBackend())
    name = str(dtype).removeprefix("torch.")
    cfg = EngineConfig(model=str(path), dtype=name, max_num_seqs=8, block_size=BLOCK, enforce_eager=True)
    runner = ModelRunner(cfg, ParallelContext(), torch.device("cpu"), dtype, 512)
    runner.init_cache(64)
    return runner


def seq(i: int, prompt: int, computed: int, rng: random.Random) -> SeqState:
    tokens = [rng.randrange(3, 500) for _ in range(prompt)]
    blocks = list(range(8 * i, 8 * i + 8))
    return SeqState(i, tokens, prompt, blocks, computed, SamplingOptions(temperature=0.0))


def both_ways(runner: ModelRunner, mi: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cut forward's rows, the full forward's rows at logits_indices)."""
    with torch.inference_mode():
        with forward_context(mi.meta):
            cut = runner.model(mi.input_ids, mi.positions, None)
        with forward_context(dataclasses.replace(mi.meta, sampled=None)):
            full = runner.model(mi.input_ids, mi.positions, None)[mi.logits_indices]
    return cut, full


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cut_rows_are_the_full_forwards(
    tiny_model_factory: Any, arch: str, backend: str, dtype: torch.dtype
) -> None:
    runner = runner_for(tiny_model_factory(arch), dtype, backend)
    rng = random.Random(0)
    # 0: a fresh prompt in one chunk; 1: the first chunk of a longer prompt (samples nothing); 2: a prompt's
    # last chunk after 40 cached tokens; 3: a one-token prompt; 4: a decode row; 5: a row with 2 drafts
    seqs = [seq(0, 37, 0, rng), seq(1, 90, 0, rng), seq(2, 70, 40, rng), seq(3, 1, 0, rng)]
    seqs += [seq(4, 30, 29, rng), seq(5, 26, 23, rng)]
    # the earlier tokens of 2, 4 and 5 must be in the cache first: one plain prefill of them
    fresh = [dataclasses.replace(seqs[i], num_computed_tokens=0) for i in (2, 4, 5)]
    warm = runner.prepare_model_input(StepBatch(0, fresh, [40, 29, 23], [0, 0, 0]))
    with torch.inference_mode(), forward_context(warm.meta):
        runner.model(warm.input_ids, warm.positions, None)
    batch = StepBatch(1, seqs, [37, 50, 30, 1, 1, 3], [0, 0, 0, 0, 0, 2])
    mi = runner.prepare_model_input(batch)
    sampled = mi.meta.sampled
    assert sampled is not None and len(sampled) == len(mi.logits_indices) == 1 + 1 + 1 + 1 + 3
    assert sampled.meta.query_lens_cpu == [1, 1, 1, 1, 3]  # sequence 1 dropped: it samples nothing
    assert sampled.meta.seq_lens_cpu == [37, 70, 1, 30, 26]
    cut, full = both_ways(runner, mi)
    assert cut.shape == full.shape == (7, runner.model.hidden_size)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cut, full, atol=tol, rtol=tol)


def test_a_step_sampling_nothing_cuts_to_no_rows(tiny_model_factory: Any) -> None:
    runner = runner_for(tiny_model_factory("llama"), torch.float32, "cpu")
    s = seq(0, 100, 0, random.Random(1))
    mi = runner.prepare_model_input(StepBatch(0, [s], [60], [0]))  # the first chunk of a longer prompt
    assert mi.meta.sampled is not None and len(mi.meta.sampled) == 0
    cut, full = both_ways(runner, mi)
    assert cut.shape == full.shape == (0, runner.model.hidden_size)
    # its K/V were written all the same: the rest of the prompt then matches a one-chunk prefill
    rest = runner.prepare_model_input(
        StepBatch(1, [dataclasses.replace(s, num_computed_tokens=60)], [40], [0])
    )
    one = runner.prepare_model_input(
        StepBatch(2, [dataclasses.replace(s, block_ids=list(range(8, 16)))], [100], [0])
    )
    torch.testing.assert_close(both_ways(runner, rest)[0], both_ways(runner, one)[0], atol=1e-5, rtol=1e-5)


def test_decode_only_and_draft_only_steps_name_no_rows(tiny_model_factory: Any) -> None:
    """Every row sampled: nothing to cut (the kernel graphs replay these steps unchanged)."""
    runner = runner_for(tiny_model_factory("llama"), torch.float32, "cpu")
    rng = random.Random(2)
    seqs = [seq(0, 20, 19, rng), seq(1, 20, 17, rng)]
    assert runner.prepare_model_input(StepBatch(0, seqs, [1, 3], [0, 2])).meta.sampled is None


def test_models_that_do_not_cut_are_indexed_by_the_runner(tiny_model_factory: Any) -> None:
    """A model class that leaves cuts_to_sampled_rows False gets every row's hidden state (none cuts now)."""
    runner = runner_for(tiny_model_factory("gpt2"), torch.float32, "cpu")
    runner.model.cuts_to_sampled_rows = False  # the instance shadows the class's True
    mi = runner.prepare_model_input(StepBatch(0, [seq(0, 30, 0, random.Random(3))], [30], [0]))
    assert mi.meta.sampled is None
