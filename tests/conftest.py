"""Shared test setup and fixtures.

tests/ goes at the END of sys.path (for `from tiny_models import ...`): tests/asyncengine mirrors the
package, and must never shadow the real `asyncengine`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# Triton's interpreter is chosen when triton is first imported: decide before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Workers leave their CPU KV cache's pages to fault in on first use (as before cpu/prefault.py): populating
# every test engine's cache (4 GiB by default) would spend seconds of a core and GiBs of memory per engine
# that the tests never touch. tests/asyncengine/cpu/test_prefault.py turns it on where it is tested; the
# variable is inherited by the worker processes the tests spawn.
os.environ.setdefault("ASYNCENGINE_CPU_KV_PREFAULT", "0")
# and keep glibc's malloc defaults (cpu/malloc.py): a test process loads dozens of models, whose freed
# activations a tuned heap would keep; tests/asyncengine/cpu/test_malloc.py covers the settings
os.environ.setdefault("ASYNCENGINE_CPU_MALLOC_TUNE", "0")

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.append(_TESTS_DIR)
