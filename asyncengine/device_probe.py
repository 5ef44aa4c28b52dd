"""Which device "auto" means, found without importing torch (the engine and server processes never do).

The workers decide for themselves (cuda/device.resolve_device, with torch); this module answers the same
question earlier, for what the engine process has to fix before they start (the KV-cache block size) and
for what it logs: CUDA when the driver shows a GPU and the installed torch is a CUDA build, else the CPU.
"""

from __future__ import annotations

import ctypes
import importlib.metadata


def torch_is_cpu_build() -> bool:
    """Whether the installed torch is a CPU-only build (version `2.x.y+cpu`), read without importing it."""
    try:
        return importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


def driver_gpu_count() -> int:
    """GPUs the CUDA driver shows this process, without torch: cuInit + cuDeviceGetCount from libcuda,
    which honour CUDA_VISIBLE_DEVICES as torch's count does; 0 without a driver or a device."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver (or not Linux): torch could see no GPU either
        return 0
    count = ctypes.c_int(0)
    if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def resolved_device(device: str, gpu_count: int | None = None) -> str:
    """`device` ("auto", "cpu" or "cuda") as the workers will resolve it. `gpu_count`: the driver's count
    where the caller has it; None asks the driver, and only when torch is a CUDA build (on a CPU build
    "auto" is the CPU whatever the driver shows)."""
    if device != "auto":
        return device
    if torch_is_cpu_build():
        return "cpu"
    return "cuda" if (driver_gpu_count() if gpu_count is None else gpu_count) > 0 else "cpu"
