"""A script that never calls LLM.shutdown() exits promptly and leaves no worker behind (it hung at
interpreter exit: __del__ waited on the engine's loop thread, which is frozen by then)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def test_script_without_shutdown_exits_and_leaves_no_worker(tiny_model_factory, tmp_path: Path) -> None:  # noqa: ANN001
    model = tiny_model_factory("llama")
    script = textwrap.dedent(
        f"""
        import os
        from asyncengine import LLM, SamplingParams
        llm = LLM(model={str(model)!r}, dtype="float32", num_kv_blocks=64)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
        print("pids", *[p.pid for p in llm.engine.executor.procs], flush=True)
        """
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=90, cwd=tmp_path
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(p) for p in done.stdout.split("pids", 1)[1].split()]
    assert elapsed < 60, f"took {elapsed:.1f}s to exit"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
