"""What compiling one constraint may cost: a size cap, and a wall-clock limit on the compile.

llguidance compiles in native code that cannot be interrupted, and its time grows with the grammar's
text (on a 2-core VM: ~0.25 s per 300 KB of JSON schema for the tokenizer-free check, as much again for
the tokenizer's compile; bench/RESULTS.md). So a constraint is bounded twice:
- its text (StructuredOutputsParams.cache_key()) may have at most MAX_GRAMMAR_CHARS characters: a larger
  one is refused before anything is compiled;
- a compile of a large one (over INLINE_COMPILE_CHARS, the ones the engine already takes off its event
  loop) runs in a small pool of threads of its own, and the caller waits for it at most
  COMPILE_TIME_LIMIT_S once it has started. Past that the request gets a StructuredOutputError (a 400)
  and the key is remembered, so the same constraint sent again is refused at once instead of costing
  another compile; the compile itself runs on to its end (the size cap bounds it) and is dropped.
  Small constraints compile on the caller's thread: they take about a millisecond, and an event loop
  must never wait on a queue.

ASYNCENGINE_GRAMMAR_COMPILE_TIMEOUT_S sets the limit (seconds) for a process.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from asyncengine.structured_output.errors import StructuredOutputError

T = TypeVar("T")

MAX_GRAMMAR_CHARS = 512 * 1024  # a 4,096-entry choice list of 100-character strings fits
INLINE_COMPILE_CHARS = 4096  # up to this, compiles run on the caller's thread (the engine's loop)
COMPILE_TIME_LIMIT_S = float(os.environ.get("ASYNCENGINE_GRAMMAR_COMPILE_TIMEOUT_S", "5"))
COMPILE_THREADS = 2  # a flood of large grammars takes two cores' worth of threads, no more
_TOO_SLOW_KEYS = 1024  # how many timed-out constraints are remembered


class KeySet:
    """The most recent `size` constraint keys, held as digests (a key may be 512 KiB of text); thread-safe.
    Remembers constraints that passed validation (spec.py) and ones that took too long (below)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()

    def __contains__(self, key: str) -> bool:  # a hit counts as a use
        digest = self._digest(key)
        with self._lock:
            if digest in self._digests:
                self._digests.move_to_end(digest)
                return True
            return False

    def add(self, key: str) -> None:
        digest = self._digest(key)
        with self._lock:
            self._digests[digest] = None
            self._digests.move_to_end(digest)
            while len(self._digests) > self._size:
                self._digests.popitem(last=False)


_pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
_too_slow = KeySet(_TOO_SLOW_KEYS)


def check_size(key: str, param: str) -> None:
    """StructuredOutputError when the constraint's text (its cache key) is over MAX_GRAMMAR_CHARS."""
    if len(key) > MAX_GRAMMAR_CHARS:
        raise StructuredOutputError(
            f"too large: {len(key):,} characters, at most {MAX_GRAMMAR_CHARS:,}", param
        )


def compile_limited(key: str, param: str, fn: Callable[[], T]) -> T:
    """fn() (a compile of the constraint `key`) under the time limit; StructuredOutputError naming
    `param` when it is too large or took too long (now, or when the same key was sent before)."""
    check_size(key, param)
    if len(key) <= INLINE_COMPILE_CHARS:
        return fn()
    if key in _too_slow:
        raise _too_slow_error(param)
    limit = COMPILE_TIME_LIMIT_S
    started = threading.Event()

    def job() -> T:
        started.set()
        return fn()

    future = _pool.submit(job)
    # queued behind at most COMPILE_THREADS compiles that each end within their size-bounded time
    if not started.wait(timeout=60.0 + 2 * limit):
        future.cancel()
        raise StructuredOutputError("the grammar compiler is busy with other requests' grammars", param)
    try:
        return future.result(timeout=limit)
    except concurrent.futures.TimeoutError:
        _too_slow.add(key)
        raise _too_slow_error(param) from None


def _too_slow_error(param: str) -> StructuredOutputError:
    return StructuredOutputError(
        f"took longer than {COMPILE_TIME_LIMIT_S:g} s to compile (the limit): too large or too complex", param
    )
