"""glibc malloc settings for a CPU worker that serves: keep freed activation memory for the next step.

A prefill step allocates its activations afresh in every layer (torch's CPU allocator is plain
malloc), megabytes each: [2048, 4096] float32 is 32 MiB. glibc serves such blocks with mmap above a
threshold that starts at 128 KiB and adapts only up to 32 MiB, and gives freed heap memory back to the
OS once 2x that threshold sits free at the top. Either way the next step's buffers land on fresh pages:
a zero-fill page fault per 4 KiB (~2 us on this VM) and, on free, munmap's TLB shootdown of the other
compute thread. Measured on 64 prompts of 16-256 tokens through a ModelRunner (2 threads, bfloat16, 4
steps of 2,048 tokens): 4.2-4.9 s and 135-254k page faults with glibc's defaults, 3.3-3.5 s and ~100k
(the KV cache's own first touches) with the settings below; the cost was spread over every small op
(rotary + KV write 0.57-0.65 -> 0.14-0.28 s, SiLU 0.17-0.22 -> 0.07-0.09 s). Through the engine (the
sweep's p16-256 row, fresh engines, 2026-12-05) the prefill-only cell took 3.4-3.5 s against 3.7-5.0 s
with the worker's page faults halved (84k -> 44k); the long-decode cell (outputs 128-512) measured level
to 4% slower (21.5-22.1 s against 20.7-21.7 s), within this VM's run-to-run spread but mostly on the slow
side, and a runner's batch-64 decode step level (58.8-62.6 ms both ways).

The settings are made after the model is loaded (the worker's init_cache), so load-time temporaries
(a checkpoint's float32 copy, quantize-at-load's bfloat16) are still returned to the OS and do not
count as resident weight memory. What they cost: the heap keeps its peak step's activations (a few
hundred MiB at a 2,048-token budget) instead of returning them between steps, as tcmalloc or jemalloc
(what vLLM's CPU docs suggest preloading) would also do. ASYNCENGINE_CPU_MALLOC_TUNE=0 keeps glibc's
defaults; non-glibc systems are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

# malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4

MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit systems
TRIM_THRESHOLD = 1 << 30  # free memory the heap may keep at its top


def enabled() -> bool:
    return os.environ.get("ASYNCENGINE_CPU_MALLOC_TUNE", "1") != "0" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> bool:
    """Make this process's malloc serve large blocks from its heap and keep freed memory (see the module
    docstring). Returns whether the settings were applied."""
    if not enabled():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # NOTE: a fixed mmap threshold also turns off glibc's adaptive one; M_MMAP_MAX = 0 sends even blocks
    # above 32 MiB to the heap (glibc still falls back to mmap if the heap cannot grow)
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_MMAP_MAX, 0),
        )
    )
    if not ok:
        logger.warning("mallopt refused a setting: large CPU activations may keep faulting in fresh pages")
    return ok
