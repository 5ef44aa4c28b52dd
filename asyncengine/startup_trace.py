"""Start-up timestamps for bench/startup.py: with ASYNCENGINE_STARTUP_TRACE=1 in the environment, the
engine process and its workers write one line per start-up milestone to stderr,

    asyncengine-startup <unix time> <process> <event>

and nothing otherwise. Standard library only: the engine process imports it before anything heavy.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "ASYNCENGINE_STARTUP_TRACE"
PREFIX = "asyncengine-startup"
_ON = os.environ.get(ENV, "") not in ("", "0")


def mark(process: str, event: str) -> None:
    """Writes `event` with the wall-clock time (comparable across processes), when tracing is on."""
    if _ON:
        try:
            os.write(sys.stderr.fileno(), f"{PREFIX} {time.time():.6f} {process} {event}\n".encode())
        except (OSError, ValueError, AttributeError):  # no usable stderr (closed, replaced by a test)
            pass
