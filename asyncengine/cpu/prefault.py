"""Faults in the pages of the CPU KV cache from a low-priority thread after start-up.

The CPU cache is an anonymous mmap that the OS zero-fills on first touch (worker/model_runner.zeros), so a
worker starts in well under a second whatever the cache size. The cost moves, not vanishes: the block
manager hands out blocks oldest-free first, so until the whole cache has been written once, every step
writes K/V into pages never touched before and takes a page fault per 4 KiB in its rotary / KV-write
kernel: 0.4-1 s per GiB measured on this VM (a few seconds of a 4-6 GiB cache, paid by the first
minutes of requests: 64 prompts of 16-1024 tokens, prefill only, took 7.9-8.6 s on fresh pages and
6.9-7.4 s on populated ones, three runs each).

Here a daemon thread at the lowest priority (nice 19) asks the kernel to populate the cache's pages,
`madvise(MADV_POPULATE_WRITE)` in 32 MiB steps (Linux 5.14+), while the engine is idle after start-up;
populating never changes a page's contents, so it may race with the worker writing K/V. Where the call
is unknown (older kernels, other systems) it stops at the first refusal and the pages fault in as before.
ASYNCENGINE_CPU_KV_PREFAULT=0 turns it off.

`ASYNCENGINE_CPU_KV_HUGEPAGES=1` also maps a prefaulted cache with transparent huge pages
(`anonymous_buffer`: a private anonymous mapping with MADV_HUGEPAGE, faulted in 2 MiB at a time by the
thread above). Off by default, as measured: decode attention over K/V blocks scattered over the cache
reads them faster on 2 MiB pages (`python bench/paged_attention.py`: 19.9-21.0 GB/s against 18.4-19.2) and
a ModelRunner's batch-64 bfloat16 decode step gains ~5% (`python bench/decode_step.py`), but end to end
through the engine (two engines side by side, runs alternating, 2026-12-06) bfloat16 was level and
float32 slower with them: a decode-heavy float32 cell 33.2-35.0 s against 28.9-32.1, its prefill-only
cell 13.8-15.1 against 13.1-13.8. (On 2 MiB pages a cache block's physical address follows its
virtual one, where 4 KiB pages scatter them over cache sets; which costs what was not pinned down.)
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, 5.14+
STEP_BYTES = 32 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def enabled() -> bool:
    return os.environ.get("ASYNCENGINE_CPU_KV_PREFAULT", "1") != "0" and os.name == "posix"


def huge_pages_enabled() -> bool:
    wanted = os.environ.get("ASYNCENGINE_CPU_KV_HUGEPAGES", "0") == "1"
    return enabled() and wanted and hasattr(mmap, "MADV_HUGEPAGE")


def anonymous_buffer(nbytes: int, huge_pages: bool) -> mmap.mmap:
    """`nbytes` of anonymous memory that the OS zero-fills on first touch; with `huge_pages`, private and
    advised for transparent huge pages (Python's default anonymous mmap is shared memory, which the
    kernel backs with 4 KiB pages unless shmem huge pages are on system-wide)."""
    if not huge_pages:
        return mmap.mmap(-1, nbytes)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except OSError as e:  # THP compiled out or turned off: 4 KiB pages, as without the advice
        logger.debug("KV cache huge pages refused: %s", e)
    return buffer


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class Prefaulter:
    """Populates the pages of `tensors` (CPU, page-aligned storage such as an mmap) from a thread of its own;
    close() stops it between steps. run() does the same on the caller's thread (tests)."""

    def __init__(self, tensors: Sequence[torch.Tensor], step_bytes: int = STEP_BYTES) -> None:
        self.regions = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]
        self.step_bytes = step_bytes
        self.populated = 0  # bytes so far
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._background, name="kv-prefault", daemon=True)
        self._thread.start()

    def _background(self) -> None:
        try:  # this thread only (a thread id is a process id to setpriority on Linux)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        self.run()

    def run(self) -> bool:
        """True when every region was populated; False if stopped or refused."""
        madvise = _madvise()
        if madvise is None:
            return False
        t0 = time.perf_counter()
        try:
            for start, size in self.regions:
                first = start // PAGE * PAGE  # mmap storage starts on a page; be safe anyway
                end = start + size
                for lo in range(first, end, self.step_bytes):
                    if self._stop.is_set():
                        return False
                    n = min(self.step_bytes, end - lo)
                    # ctypes releases the GIL for the call: the worker's Python runs on meanwhile
                    if madvise(lo, n, MADV_POPULATE_WRITE) != 0:
                        err = ctypes.get_errno()
                        logger.debug("KV cache pre-fault stopped: madvise: %s", os.strerror(err))
                        return False
                    self.populated += n
            return True
        finally:
            self.seconds = time.perf_counter() - t0
            if self.populated:
                logger.debug("KV cache pre-faulted: %.2f GiB in %.2f s", self.populated / 2**30, self.seconds)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
