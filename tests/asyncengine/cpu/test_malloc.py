"""cpu/malloc.py: after keep_freed_memory() a step's large activations reuse the pages the last step
freed instead of faulting in fresh ones. Each case runs in a fresh interpreter: the settings are
process-wide and would outlive the test."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"),
    pytest.mark.timeout(120),
]

PROGRAM = """
import json, resource, sys
import torch
from asyncengine.cpu.malloc import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "tune" else False
def step():  # a layer's worth of large activations, allocated, written and freed
    a = torch.empty(12 << 20, dtype=torch.float32).fill_(1.0)  # 48 MiB: above glibc's mmap limit
    b = torch.empty(8 << 20, dtype=torch.float32).fill_(2.0)  # 32 MiB
    return float(a[-1] + b[-1])
for _ in range(5):  # the heap grows to its high-water mark (an aligned block does not refit its own hole)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    assert step() == 3.0
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def run(mode: str, **env: str) -> dict[str, int | bool]:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode],
        env={**os.environ, "ASYNCENGINE_CPU_MALLOC_TUNE": "1", **env},
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_activations_are_reused_without_page_faults() -> None:
    pages_per_step = (80 << 20) // os.sysconf("SC_PAGE_SIZE")
    default = run("default")
    tuned = run("tune")
    assert tuned["applied"] is True
    assert default["faults"] > 5 * pages_per_step  # glibc's defaults: fresh pages every step
    # the heap keeps them (it may still grow once: an aligned block does not always refit its own hole)
    assert tuned["faults"] < pages_per_step


def test_the_switch_keeps_glibc_defaults() -> None:
    assert run("tune", ASYNCENGINE_CPU_MALLOC_TUNE="0")["applied"] is False
