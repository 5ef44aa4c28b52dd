"""The KV-cache block size defaults by device (config.CPU_BLOCK_SIZE / CUDA_BLOCK_SIZE), fixed once in the
engine process so that every worker is sent the same number; "auto" is resolved without torch."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from asyncengine import device_probe
from asyncengine.config import CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE, EngineConfig
from asyncengine.sampling_params import SamplingParams


def test_default_block_size_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CPU_BLOCK_SIZE != CUDA_BLOCK_SIZE
    assert EngineConfig(device="cpu").block_size == CPU_BLOCK_SIZE
    assert EngineConfig(device="cuda").block_size == CUDA_BLOCK_SIZE
    assert EngineConfig(device="cuda", block_size=32).block_size == 32  # given: kept on any device
    # "auto": a CUDA torch build with a GPU in sight means CUDA; a CPU build or no GPU means the CPU
    monkeypatch.setattr(device_probe, "torch_is_cpu_build", lambda: False)
    monkeypatch.setattr(device_probe, "driver_gpu_count", lambda: 1)
    assert EngineConfig().block_size == CUDA_BLOCK_SIZE
    monkeypatch.setattr(device_probe, "driver_gpu_count", lambda: 0)
    assert EngineConfig().block_size == CPU_BLOCK_SIZE
    monkeypatch.setattr(device_probe, "driver_gpu_count", lambda: 2)
    monkeypatch.setattr(device_probe, "torch_is_cpu_build", lambda: True)
    assert EngineConfig().block_size == CPU_BLOCK_SIZE


def test_resolved_block_size_survives_replace_and_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine resolves it; a worker decoding the config (on whatever it would resolve) keeps it."""
    monkeypatch.setattr(device_probe, "torch_is_cpu_build", lambda: False)
    monkeypatch.setattr(device_probe, "driver_gpu_count", lambda: 1)
    config = EngineConfig()
    assert config.block_size == CUDA_BLOCK_SIZE
    monkeypatch.setattr(device_probe, "driver_gpu_count", lambda: 0)  # the worker's view differs
    assert config.replace(dtype="float32").block_size == CUDA_BLOCK_SIZE
    assert msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig).block_size == CUDA_BLOCK_SIZE


def test_resolved_device_takes_a_given_count_never_probing_a_cpu_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_probe() -> int:
        raise AssertionError("the driver was asked")

    monkeypatch.setattr(device_probe, "driver_gpu_count", no_probe)
    assert device_probe.resolved_device("cpu") == "cpu"
    assert device_probe.resolved_device("cuda") == "cuda"
    monkeypatch.setattr(device_probe, "torch_is_cpu_build", lambda: True)
    assert device_probe.resolved_device("auto") == "cpu"
    monkeypatch.setattr(device_probe, "torch_is_cpu_build", lambda: False)
    assert device_probe.resolved_device("auto", gpu_count=1) == "cuda"
    assert device_probe.resolved_device("auto", gpu_count=0) == "cpu"


def test_engine_uses_the_default_block_size(tiny_model_factory: Any, llm_factory: Any) -> None:
    """The scheduler's blocks and the workers' cache blocks agree at the CPU default: greedy output over a
    prompt longer than one block, decoded into a third, is the same as with 16-token blocks."""
    model = tiny_model_factory("llama")
    prompt = [3 + i % 400 for i in range(CPU_BLOCK_SIZE + 21)]  # spans two blocks of the default size
    params = SamplingParams(temperature=0.0, max_tokens=CPU_BLOCK_SIZE + 8, ignore_eos=True)
    outs = []
    for block_size in (None, 16):
        blocks = 4096 // (block_size or CPU_BLOCK_SIZE)  # the same tokens either way
        llm = llm_factory(model, num_kv_blocks=blocks, block_size=block_size, device="cpu")
        assert llm.config.block_size == (block_size or CPU_BLOCK_SIZE)
        outs.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
        llm.shutdown()
    assert len(outs[0]) == CPU_BLOCK_SIZE + 8
    assert outs[0] == outs[1]
