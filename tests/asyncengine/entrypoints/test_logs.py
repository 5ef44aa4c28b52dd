"""What `asyncengine serve` logs: one format for every logger (uvicorn's included), the start-up line,
the periodic throughput line (quiet while idle), and no transformers warning for over-long prompts."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from server_process import start_server

from asyncengine.config import CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE, EngineConfig, default_model_path
from asyncengine.entrypoints import log_stats
from asyncengine.entrypoints.log_stats import Reading, resolved_dtype, startup_line, throughput_line
from asyncengine.entrypoints.logging_config import (
    LOG_FORMAT,
    TOO_LONG_LOGGER,
    DropTooLongWarning,
    silence_too_long_warning,
    uvicorn_log_config,
)
from asyncengine.model_config import ModelConfig
from asyncengine.stats import EngineStats, StatsSnapshot

pytestmark = pytest.mark.timeout(120)
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
# the worker processes share the server's stderr, with their own format (asyncengine/worker/main.py)
WORKER_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} worker\d+ ")


def snap(
    t: float, prompt: float = 0, gen: float = 0, running: int = 0, waiting: int = 0, usage: float = 0.0
) -> StatsSnapshot:
    return StatsSnapshot(t, prompt, gen, running, waiting, usage)


# -- formats --------------------------------------------------------------------------------------
def test_uvicorn_loggers_use_the_engine_format() -> None:
    cfg = uvicorn_log_config("warning")
    assert cfg["formatters"]["asyncengine"]["format"] == LOG_FORMAT
    assert cfg["disable_existing_loggers"] is False  # the engine's loggers keep logging
    assert cfg["handlers"]["stderr"]["formatter"] == "asyncengine"
    for name in ("uvicorn", "uvicorn.access"):  # uvicorn.error propagates to uvicorn
        assert cfg["loggers"][name]["handlers"] == ["stderr"] and cfg["loggers"][name]["level"] == "WARNING"
    # uvicorn's access record, formatted as every other line
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        "h11_impl.py",
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/health", "1.1", 200),
        None,
    )
    line = logging.Formatter(LOG_FORMAT).format(record)
    assert LINE.match(line) and line.endswith(
        'INFO uvicorn.access: 127.0.0.1:5000 - "GET /health HTTP/1.1" 200'
    )


def test_throughput_line() -> None:
    a = Reading(snap(10.0, prompt=100, gen=1000, running=0), 0, 0)
    b = Reading(snap(15.0, prompt=150, gen=1500, running=3, waiting=1, usage=0.125), 32, 64)
    assert throughput_line(a, b) == (
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 100.0 "
        "tokens/s, Running: 3 seqs, Waiting: 1 seqs, KV cache usage: 12.5%, "
        "Prefix cache hit rate: 50.0%"
    )
    # no prompt in the interval: no hit rate; prefix caching off: never
    assert throughput_line(b, Reading(snap(20.0, 150, 1600, 1), 32, 64)).endswith("KV cache usage: 0.0%")
    assert "Prefix" not in throughput_line(Reading(snap(0.0)), Reading(snap(1.0, prompt=5)))


def test_quiet_when_idle_but_not_right_after_work() -> None:
    idle = Reading(snap(0.0, 10, 20))
    assert throughput_line(idle, Reading(snap(5.0, 10, 20))) is None  # nothing went through, nothing live
    assert throughput_line(idle, Reading(snap(5.0, 10, 25))) is not None  # finished within the interval
    assert throughput_line(idle, Reading(snap(5.0, 10, 20, waiting=2))) is not None  # queued, stuck


def test_snapshot_reads_the_counters_and_the_scheduler_gauges() -> None:
    stats = EngineStats()
    stats.bind_scheduler(lambda: 3, lambda: 2, lambda: 0.25, lambda: 7)
    stats.on_arrival(11)
    stats.generation_tokens.inc(5)
    s = stats.snapshot()
    assert (s.prompt_tokens, s.generation_tokens, s.running, s.waiting, s.kv_usage) == (11, 5, 3, 2, 0.25)
    assert s.time == pytest.approx(time.monotonic(), abs=5)


def fake_engine(
    config: EngineConfig, blocks: int = 256, max_model_len: int = 1024, hf: dict | None = None
) -> SimpleNamespace:
    return SimpleNamespace(
        config=config,
        hf_config=ModelConfig(hf or {"dtype": "float32"}),
        num_kv_blocks=blocks,
        max_model_len=max_model_len,
    )


def test_startup_line() -> None:
    engine = fake_engine(EngineConfig(device="cpu"))  # the CPU's default block size
    assert startup_line(engine, "default-model", gpu_count=0) == (
        f"engine ready: model default-model ({default_model_path()}), dtype float32, device cpu, "
        f"parallel tp 1 x pp 1 (1 node), KV cache 256 blocks x {CPU_BLOCK_SIZE} = {256 * CPU_BLOCK_SIZE} "
        f"tokens (kv float32), max_model_len 1024 ({256 * CPU_BLOCK_SIZE / 1024:.2f}x "
        "concurrency at that length), prefix caching on"
    )
    line = startup_line(
        fake_engine(
            EngineConfig(
                device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e5m2", enable_prefix_caching=False
            ),
            blocks=10,
        ),
        "m",
        gpu_count=1,
    )
    assert "dtype bfloat16, device cuda" in line and "(kv fp8_e5m2)" in line and "prefix caching off" in line


def test_resolved_dtype_follows_the_workers_rule() -> None:
    auto = EngineConfig()
    assert resolved_dtype(auto, ModelConfig({"torch_dtype": "float16"}), "cuda") == "float16"
    assert resolved_dtype(auto, ModelConfig({"torch_dtype": "float16"}), "cpu") == "bfloat16"  # CPU: bf16
    assert resolved_dtype(auto, ModelConfig({"dtype": "bfloat16"}), "cpu") == "bfloat16"
    assert resolved_dtype(auto, ModelConfig({}), "cuda") == "float32"
    assert (
        resolved_dtype(EngineConfig(dtype="float16"), ModelConfig({"dtype": "float32"}), "cpu") == "float16"
    )


async def test_log_stats_logs_while_busy_only(caplog: pytest.LogCaptureFixture) -> None:
    readings = iter([snap(0.0), snap(1.0, 4, 10, running=2), snap(2.0, 4, 10), snap(3.0, 4, 10)])
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(block_manager=None), stats=SimpleNamespace(snapshot=lambda: next(readings))
    )
    caplog.set_level(logging.INFO, "asyncengine.stats")
    task = asyncio.create_task(log_stats.log_stats(lambda: engine, interval_s=0.01))
    await asyncio.sleep(0.2)
    task.cancel()
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncengine.stats"]
    assert len(lines) == 1 and lines[0].startswith(
        "Avg prompt throughput: 4.0 tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 2 seqs"
    )


# -- transformers' over-long-sequence warning -------------------------------------------------------
def test_the_too_long_warning_is_dropped() -> None:
    from transformers import AutoTokenizer

    target = logging.getLogger(TOO_LONG_LOGGER)
    before = list(target.filters)
    seen: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    target.addHandler(catch)  # sees what the logger's filters let through
    try:
        for f in [f for f in target.filters if isinstance(f, DropTooLongWarning)]:
            target.removeFilter(f)
        text = "def f(x):\n    return x\n" * 100

        def encode() -> list[str]:  # a fresh tokenizer: each warns once at most
            seen.clear()
            tok = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
            tok.model_max_length = 16
            tok.encode(text)
            return [m for m in seen if "Token indices sequence length" in m]

        assert encode()  # what the server printed before
        silence_too_long_warning()
        silence_too_long_warning()  # idempotent
        assert sum(isinstance(f, DropTooLongWarning) for f in target.filters) == 1
        assert not encode()
    finally:
        target.removeHandler(catch)
        target.filters[:] = before


# -- a real server --------------------------------------------------------------------------------
@pytest.mark.slow
def test_server_logs_startup_and_throughput_in_one_format(tmp_path: Path) -> None:
    srv = start_server(Path(default_model_path()), tmp_path, "--log-stats-interval", "0.5", "--access-log")
    try:
        r = httpx.post(
            f"{srv.base}/v1/completions",
            timeout=60,
            json={
                "prompt": "import os\n\ndef read_file(path):",
                "max_tokens": 64,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200
        deadline = time.monotonic() + 20
        while (
            "asyncengine.stats: Avg prompt throughput" not in srv.log.read_text()
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        time.sleep(1.5)  # idle from here on: no more throughput lines
        quiet_from = srv.log.read_text().count("Avg prompt throughput")
        time.sleep(1.5)
        log = srv.log.read_text()
    finally:
        srv.kill()
    assert log.count("Avg prompt throughput") == quiet_from, log
    lines = [line for line in log.splitlines() if line.strip() and "loading weights" not in line]  # tqdm
    # one format, uvicorn's included (its own was "INFO:     Started server process")
    assert lines and all(LINE.match(line) or WORKER_LINE.match(line) for line in lines), log
    startup = next(line for line in lines if "engine ready:" in line)
    assert re.search(
        r"INFO asyncengine\.serve: engine ready: model default-model \(.*default-model\), dtype "
        rf"float32, device (cpu|cuda), parallel tp 1 x pp 1 \(1 node\), KV cache 256 blocks x "
        rf"({CPU_BLOCK_SIZE} = {256 * CPU_BLOCK_SIZE}|{CUDA_BLOCK_SIZE} = {256 * CUDA_BLOCK_SIZE}) "
        r"tokens \(kv float32\), max_model_len 1024 ",
        startup,
    ), startup
    throughput = next(line for line in lines if "Avg prompt throughput" in line)
    assert re.search(
        r"INFO asyncengine\.stats: Avg prompt throughput: [\d.]+ tokens/s, Avg generation "
        r"throughput: [\d.]+ tokens/s, Running: \d+ seqs, Waiting: \d+ seqs, KV cache usage: "
        r"[\d.]+%",
        throughput,
    ), throughput
    assert any(
        re.search(r'INFO uvicorn\.access: 127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 200', line)
        for line in lines
    ), log
    assert any("INFO uvicorn.error: Started server process" in line for line in lines), log
