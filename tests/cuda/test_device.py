"""Device binding: device resolution, CUDA rank checks, CPU thread shares, the process-group backend."""

import pytest
import torch

from asyncengine.cuda import device as device_mod
from asyncengine.cuda.device import (
    DeviceError,
    bind_device,
    cpu_threads_per_worker,
    dist_backend,
    resolve_device,
)


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_resolve_device():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_requested_without_cuda():
    with pytest.raises(DeviceError, match="no CUDA"):
        resolve_device("cuda")


def test_cpu_threads_share_the_cores(monkeypatch, restore_threads):
    monkeypatch.setattr(device_mod, "available_cpus", lambda: 16)
    assert cpu_threads_per_worker(4) == 4
    assert cpu_threads_per_worker(3) == 5
    assert cpu_threads_per_worker(32) == 1  # at least one
    assert bind_device("cpu", local_rank=1, world_size=4) == torch.device("cpu")
    assert torch.get_num_threads() == 4
    bind_device("cpu", local_rank=0, world_size=4, num_threads=2)
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError):
        bind_device("cpu", local_rank=0, world_size=1, num_threads=0)


def test_rank_checks():
    with pytest.raises(ValueError):
        bind_device("cpu", local_rank=2, world_size=2)
    with pytest.raises(ValueError):
        bind_device("cpu", local_rank=-1, world_size=2)


def test_cuda_binding_rejects_missing_gpu(monkeypatch):
    # Pretend a one-GPU host so the rank check runs without CUDA.
    monkeypatch.setattr(device_mod, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    set_calls = []
    monkeypatch.setattr(torch.cuda, "set_device", set_calls.append)
    with pytest.raises(DeviceError, match="only 1 CUDA device"):
        bind_device("cuda", local_rank=1, world_size=2)
    assert bind_device("cuda", local_rank=0, world_size=2) == torch.device("cuda", 0)
    assert set_calls == [0]


def test_binding_leaves_cuda_visible_devices_alone(monkeypatch, restore_threads):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    bind_device("cpu", local_rank=0, world_size=1)
    import os

    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_dist_backend():
    assert dist_backend("cpu") == "gloo"
    assert dist_backend(torch.device("cpu")) == "gloo"
    assert dist_backend("cuda") == "nccl"
    assert dist_backend(torch.device("cuda", 1)) == "nccl"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_binding_on_gpu():
    assert bind_device("cuda", local_rank=0, world_size=1) == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0
