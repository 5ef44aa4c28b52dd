"""KV-cache sizing: bytes per block, blocks from a budget, the CPU default budget, the profile arithmetic."""

import pytest
import torch

from asyncengine.cuda import memory
from asyncengine.cuda.memory import (
    GiB,
    KVCacheTooSmallError,
    blocks_per_seq,
    cpu_kv_cache_budget,
    kv_budget_from_profile,
    kv_cache_bytes_per_block,
    num_kv_blocks_from_budget,
    profile_and_size,
    size_kv_cache_cpu,
)


def test_bytes_per_block():
    # K and V, 2 layers, 16 tokens, 4 heads, 64 dims, 2 bytes each.
    assert kv_cache_bytes_per_block(2, 16, 4, 64, torch.bfloat16) == 2 * 2 * 16 * 4 * 64 * 2
    assert kv_cache_bytes_per_block(1, 32, 1, 80, torch.float32) == 2 * 32 * 80 * 4


def test_blocks_from_budget_floors_and_checks_one_sequence():
    assert blocks_per_seq(33, 16) == 3 and blocks_per_seq(32, 16) == 2
    assert num_kv_blocks_from_budget(1000, 100, block_size=16, max_model_len=32) == 10
    assert num_kv_blocks_from_budget(1099, 100, block_size=16, max_model_len=160) == 10  # exactly fits
    with pytest.raises(KVCacheTooSmallError, match="max_model_len=161") as info:
        num_kv_blocks_from_budget(1099, 100, block_size=16, max_model_len=161)
    assert isinstance(info.value, ValueError)
    assert "needs 11 blocks" in str(info.value)
    with pytest.raises(KVCacheTooSmallError):
        num_kv_blocks_from_budget(-5, 100, block_size=16, max_model_len=1)


def test_cpu_budget_default_and_explicit(monkeypatch):
    assert cpu_kv_cache_budget(12345) == 12345
    with pytest.raises(ValueError):
        cpu_kv_cache_budget(0)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 8 * GiB)
    assert cpu_kv_cache_budget() == 2 * GiB  # a quarter of available RAM
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 64 * GiB)
    assert cpu_kv_cache_budget() == 4 * GiB  # capped
    bytes_per_block = kv_cache_bytes_per_block(2, 16, 2, 64, torch.float32)
    assert size_kv_cache_cpu(bytes_per_block, 16, 256, kv_cache_memory_bytes=bytes_per_block * 20) == 20
    with pytest.raises(KVCacheTooSmallError):
        size_kv_cache_cpu(bytes_per_block, 16, 400, kv_cache_memory_bytes=bytes_per_block * 20)


def test_available_memory_is_positive():
    assert memory.available_memory_bytes() > 0


def test_profile_arithmetic():
    # 100 GiB card at 0.9: 90 GiB ours; 20 used before (weights, context), 5 peak activations,
    # 1 NCCL/cuBLAS, 2 graphs -> 62 GiB for the KV cache.
    budget = kv_budget_from_profile(100 * GiB, 80 * GiB, 5 * GiB, 1 * GiB, 0.9, graph_memory_bytes=2 * GiB)
    assert budget == 62 * GiB
    assert kv_budget_from_profile(100, 100, -3, -1, 1.0) == 100  # negative noise is ignored
    with pytest.raises(ValueError):
        kv_budget_from_profile(100, 100, 0, 0, 0.0)
    with pytest.raises(ValueError):
        kv_budget_from_profile(100, 100, 0, 0, 1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_profile_and_size_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        profile_and_size(lambda: None, 1024, 0.5, block_size=16, max_model_len=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_and_size_counts_activations():
    bytes_per_block = 1 << 20
    kept = []

    def run_profile() -> None:
        kept.append(torch.empty(0, device="cuda"))
        torch.empty(512 << 20, dtype=torch.uint8, device="cuda")  # a 512 MiB activation peak

    free, total = torch.cuda.mem_get_info()
    blocks = profile_and_size(run_profile, bytes_per_block, 0.5, block_size=16, max_model_len=16)
    expected = (int(total * 0.5) - (total - free) - (512 << 20)) // bytes_per_block
    assert abs(blocks - expected) <= 64  # allocator rounding and context noise
