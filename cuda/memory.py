"""KV-cache sizing: how many paged blocks fit in the memory left after weights, activations and graphs.

On CUDA the budget comes from profiling one forward pass at the scheduler's token budget; on CPU it is
an explicit byte budget (default: min(4 GiB, a quarter of the available RAM)).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB


class KVCacheTooSmallError(ValueError):
    """Not even one sequence of max_model_len fits in the KV-cache budget."""


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block across all layers: a K and a V tensor of [block_size, num_kv_heads, head_dim]."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def blocks_per_seq(max_model_len: int, block_size: int) -> int:
    """Blocks one sequence of max_model_len tokens needs."""
    return -(-max_model_len // block_size)


def num_kv_blocks_from_budget(
    budget_bytes: int, bytes_per_block: int, block_size: int, max_model_len: int
) -> int:
    """Whole blocks that fit in budget_bytes; KVCacheTooSmallError if one max_model_len sequence does not."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    num_blocks = max(0, budget_bytes) // bytes_per_block
    needed = blocks_per_seq(max_model_len, block_size)
    if num_blocks < needed:
        raise KVCacheTooSmallError(
            f"KV cache too small: {max(0, budget_bytes) / GiB:.2f} GiB holds {num_blocks} blocks of "
            f"{bytes_per_block} bytes, but one sequence of max_model_len={max_model_len} needs {needed} "
            f"blocks of {block_size} tokens ({needed * bytes_per_block / GiB:.2f} GiB). Raise "
            f"gpu_memory_utilization or kv_cache_memory_bytes, or lower max_model_len."
        )
    return num_blocks


def available_memory_bytes() -> int:
    """Host RAM available to new allocations: MemAvailable from /proc/meminfo, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX sysconf (macOS lacks SC_AVPHYS_PAGES)
        return DEFAULT_CPU_KV_CACHE_BYTES * 4


def cpu_kv_cache_budget(kv_cache_memory_bytes: int | None = None) -> int:
    """The CPU byte budget: the explicit value if given, else min(4 GiB, available RAM / 4)."""
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {kv_cache_memory_bytes}")
        return kv_cache_memory_bytes
    return min(DEFAULT_CPU_KV_CACHE_BYTES, available_memory_bytes() // 4)


def size_kv_cache_cpu(
    bytes_per_block: int, block_size: int, max_model_len: int, kv_cache_memory_bytes: int | None = None
) -> int:
    """Number of KV blocks on CPU for the given (or default) byte budget."""
    budget = cpu_kv_cache_budget(kv_cache_memory_bytes)
    return num_kv_blocks_from_budget(budget, bytes_per_block, block_size, max_model_len)


def kv_budget_from_profile(
    total_bytes: int,
    free_before_bytes: int,
    activation_peak_bytes: int,
    non_torch_increase_bytes: int,
    gpu_memory_utilization: float,
    graph_memory_bytes: int = 0,
) -> int:
    """The arithmetic of profile_and_size, separate so it is testable without a GPU.

    Our share of the device is total * utilization. Everything already in use before the profile
    (weights, CUDA context, other processes) counts against it, as do the profile's activation peak,
    memory allocated outside torch's allocator during it (NCCL, cuBLAS workspaces) and the CUDA graphs.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    requested = int(total_bytes * gpu_memory_utilization)
    used_before = total_bytes - free_before_bytes
    overhead = max(0, activation_peak_bytes) + max(0, non_torch_increase_bytes) + max(0, graph_memory_bytes)
    return requested - used_before - overhead


def profile_and_size(
    run_profile: Callable[[], None],
    bytes_per_block: int,
    gpu_memory_utilization: float,
    graph_memory_bytes: int = 0,
    *,
    block_size: int,
    max_model_len: int,
    device: torch.device | int | None = None,
) -> int:
    """Runs `run_profile` (one forward at the token budget, KV cache not yet allocated) and returns how
    many KV blocks fit in the rest of this process's share of the GPU.

    `graph_memory_bytes` reserves room for CUDA graphs captured later (an estimate or a measurement).
    Raises KVCacheTooSmallError when one sequence of max_model_len does not fit.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("profile_and_size needs CUDA; on CPU use size_kv_cache_cpu")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # cached-but-free blocks would otherwise look used
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    allocated_before = torch.cuda.memory_allocated(device)
    non_torch_before = (total - free_before) - torch.cuda.memory_reserved(device)

    run_profile()
    torch.cuda.synchronize(device)

    free_after, _ = torch.cuda.mem_get_info(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - allocated_before
    non_torch_increase = ((total - free_after) - torch.cuda.memory_reserved(device)) - non_torch_before
    torch.cuda.empty_cache()  # hand the profile's activations back before the KV cache is allocated
    budget = kv_budget_from_profile(
        total, free_before, activation_peak, non_torch_increase, gpu_memory_utilization, graph_memory_bytes
    )
    return num_kv_blocks_from_budget(budget, bytes_per_block, block_size, max_model_len)
