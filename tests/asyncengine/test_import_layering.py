"""The engine process imports no torch, no transformers and no model code (issue 20): importing the
engine, the executor, the server and the CLI, and starting an engine's workers and reading its config
and tokenizer, happen in fresh interpreters and leave those modules out of sys.modules."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from asyncengine.config import EngineConfig, default_model_path
from asyncengine.entrypoints import launcher
from asyncengine.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

ENGINE_SIDE = (
    "asyncengine.engine",
    "asyncengine.executor",
    "asyncengine.entrypoints.server",
    "asyncengine.entrypoints.openai_api",
    "asyncengine.entrypoints.websocket",
    "asyncengine.entrypoints.launcher",
    "asyncengine.entrypoints.cli",
    "asyncengine.llm",
    "asyncengine",
    "asyncengine.transport.topology",
    "asyncengine.model_config",
    "asyncengine.tokenizer",
)
FORBIDDEN = ("torch", "transformers", "ray")  # ray: only the ray backend imports it
FORBIDDEN_PREFIXES = (
    "asyncengine.models",
    "asyncengine.layers",
    "asyncengine.cpu",
    "asyncengine.worker",
    "asyncengine.cuda",
)


def forbidden(modules: list[str]) -> list[str]:
    return sorted(
        m
        for m in modules
        if m in FORBIDDEN
        or m.split(".")[0] in FORBIDDEN
        or any(m == p or m.startswith(p + ".") for p in FORBIDDEN_PREFIXES)
    )


def fresh_modules(code: str) -> list[str]:
    """sys.modules after running `code` in a fresh interpreter."""
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_side_modules_import_no_torch_nor_model_code() -> None:
    modules = fresh_modules("\n".join(f"import {m}" for m in ENGINE_SIDE))
    assert forbidden(modules) == []


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"]])
def test_cli_help_imports_no_torch(argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "asyncengine", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "usage: asyncengine" in out.stdout
    imported = [
        line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")
    ]
    assert "asyncengine.entrypoints.cli" in imported  # the check sees the CLI's imports
    assert forbidden(imported) == []


def test_engine_start_up_reads_config_and_tokenizer_without_torch() -> None:
    """At run time too: the engine spawns its workers, reads config.json and the tokenizer, and stops
    them; the worker processes import torch, this one does not."""
    modules = fresh_modules(f"""
        from asyncengine.config import EngineConfig
        from asyncengine.engine import AsyncEngine
        engine = AsyncEngine(EngineConfig(model={default_model_path()!r}, num_threads=1))
        try:
            assert type(engine.tokenizer).__name__ == "FastTokenizer", type(engine.tokenizer)
            assert engine.max_model_len == 1024 and engine.vocab_size == 4096
            assert engine.tokenizer.decode(engine.tokenizer.encode("Once upon a time")) == "Once upon a time"
        finally:
            engine.executor.shutdown()
    """)
    assert forbidden(modules) == []


def test_check_devices_counts_gpus_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's count decides unless it would fail the launch; torch is asked only then."""
    monkeypatch.setattr(launcher, "driver_gpu_count", lambda: 2)
    launcher.check_devices(EngineConfig(device="cuda", tensor_parallel_size=2))  # fits: nothing else asked
    launcher.check_devices(EngineConfig(device="cpu", tensor_parallel_size=4))  # CPU: no count at all
    monkeypatch.setattr(launcher, "driver_gpu_count", lambda: 0)
    launcher.check_devices(EngineConfig(device="auto"))  # no GPU: auto runs on the CPU
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        launcher.check_devices(EngineConfig(device="cuda"))


def test_check_devices_confirms_with_torch_before_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(launcher, "driver_gpu_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="needs 2 GPUs on this node, but 1 are visible"):
        launcher.check_devices(EngineConfig(device="auto", tensor_parallel_size=2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch build: auto means CPU
    launcher.check_devices(EngineConfig(device="auto", tensor_parallel_size=2))


def test_driver_gpu_count_is_zero_or_more() -> None:
    assert launcher.driver_gpu_count() >= 0
