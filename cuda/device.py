"""Device binding for one worker process: which accelerator (or how many CPU threads) it uses.

CUDA when present, CPU otherwise. A CUDA worker binds to GPU `local_rank` with torch.cuda.set_device
and leaves every device visible: rewriting CUDA_VISIBLE_DEVICES after CUDA is initialised does nothing,
and hiding peers breaks NCCL's peer-to-peer paths. A CPU worker gets its share of the cores so that
world_size workers on one host do not oversubscribe it.
"""

from __future__ import annotations

import os

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class DeviceError(RuntimeError):
    """The requested device does not exist on this host."""


def resolve_device(device: str = "auto") -> str:
    """Maps "auto" to "cuda" when a GPU is usable, else "cpu"; checks that "cuda" is really there."""
    if device not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device='cuda' but no CUDA device is available (CPU-only torch build or no GPU)")
    return device


def available_cpus() -> int:
    """Cores this process may run on: its affinity mask (respects taskset/cgroup cpusets), else cpu_count."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def cpu_threads_per_worker(world_size: int) -> int:
    """cores // world_size, at least 1."""
    return max(1, available_cpus() // max(1, world_size))


def bind_device(
    device: str,
    local_rank: int,
    world_size: int,
    num_threads: int | None = None,
    device_id: int | None = None,
) -> torch.device:
    """Binds this worker process to its device and returns it.

    device: "auto", "cpu" or "cuda". On CUDA, GPU `device_id` when given (a Ray actor's physical GPU,
    ray_worker_host.cuda_index), else `local_rank`; all GPUs stay visible either way. On CPU, torch
    uses num_threads threads, or cores // world_size (at least 1) when num_threads is None.
    """
    if local_rank < 0 or world_size < 1 or local_rank >= world_size:
        raise ValueError(
            f"need 0 <= local_rank < world_size, got local_rank={local_rank}, world_size={world_size}"
        )
    kind = resolve_device(device)
    if kind == "cuda":
        index = local_rank if device_id is None else device_id
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise DeviceError(
                f"rank on this node needs GPU {index}, but only {count} CUDA device(s) are "
                f"visible; lower the parallel size or expose more GPUs"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads if num_threads is not None else cpu_threads_per_worker(world_size))
    return torch.device("cpu")


def dist_backend(device: torch.device | str) -> str:
    """The torch.distributed backend for a device: NCCL between GPUs, gloo on CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"
