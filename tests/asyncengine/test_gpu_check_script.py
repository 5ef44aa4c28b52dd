"""bench/gpu_check.py is the one script a lent GPU machine runs; its ModelRunner loop runs here on CPU
so that it cannot rot where no GPU is at hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tiny_models import build_tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_decode_throughput_loop_runs_on_cpu(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    model = build_tiny_model("llama", tmp_path / "llama")
    tok_s = gpu_check.decode_throughput(model, batch=3, eager=True, steps=4, device="cpu")
    assert tok_s > 0
