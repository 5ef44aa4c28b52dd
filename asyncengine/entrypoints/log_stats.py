"""What `asyncengine serve` logs about its engine: one line once it is ready, then throughput while busy.

    ... INFO asyncengine.serve: engine ready: model default-model (/path/default-model), dtype float32,
        device cpu, parallel tp 1 x pp 1 (1 node), KV cache 256 blocks x 64 = 16384 tokens (kv float32),
        max_model_len 1024 (16.00x concurrency at that length), prefix caching on
    ... INFO asyncengine.stats: Avg prompt throughput: 28.0 tokens/s,
        Avg generation throughput: 510.2 tokens/s, Running: 4 seqs, Waiting: 0 seqs,
        KV cache usage: 12.5%, Prefix cache hit rate: 50.0%

The throughput line comes every interval in which tokens went through or sequences were running or
waiting (vLLM's), and not at all while the server is idle. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from asyncengine.device_probe import resolved_device
from asyncengine.dp_engine import DataParallelEngine
from asyncengine.stats import StatsSnapshot

if TYPE_CHECKING:
    from asyncengine.config import EngineConfig
    from asyncengine.engine import AsyncEngine

logger = logging.getLogger("asyncengine.stats")
DEFAULT_INTERVAL_S = 5.0
_DTYPE_NAMES = {
    "float": "float32",
    "float32": "float32",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
}


# -- the start-up line ----------------------------------------------------------------------------
def resolved_dtype(config: EngineConfig, hf_config: Any, device: str) -> str:
    """The weights' dtype as the workers choose it (worker.resolve_dtype): --dtype, else the checkpoint's,
    with float16 run as bfloat16 on a CPU."""
    if config.dtype != "auto":
        return config.dtype
    raw = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    name = (
        _DTYPE_NAMES.get(str(raw).removeprefix("torch."), "float32")
        if raw not in (None, "auto")
        else "float32"
    )
    return "bfloat16" if device == "cpu" and name == "float16" else name


def startup_line(engine: AsyncEngine, served_name: str, gpu_count: int) -> str:
    """The engine's model, dtype, device, parallel layout, KV cache and context length, in one line."""
    config = engine.config
    device = resolved_device(config.device, gpu_count)
    dtype = resolved_dtype(config, engine.hf_config, device)
    kv_dtype = dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    blocks = engine.num_kv_blocks
    tokens = blocks * config.block_size
    nodes = f"{config.nnodes} node" + ("s" if config.nnodes > 1 else "")
    return (
        f"engine ready: model {served_name} ({config.model}), dtype {dtype}, device {device}, parallel "
        f"tp {config.tensor_parallel_size} x pp {config.pipeline_parallel_size} ({nodes})"
        f"{f' x dp {config.data_parallel_size} replicas' if config.data_parallel_size > 1 else ''}, "
        f"KV cache {blocks} "
        f"blocks x {config.block_size} = {tokens} tokens (kv {kv_dtype}), "
        f"max_model_len {engine.max_model_len} "
        f"({tokens / engine.max_model_len:.2f}x concurrency at that length), prefix caching "
        f"{'on' if config.enable_prefix_caching else 'off'}"
    )


# -- the throughput lines -------------------------------------------------------------------------
class Reading(NamedTuple):
    """One engine's stats at one moment, with the prefix cache's token counts (None: caching off)."""

    stats: StatsSnapshot
    prefix_hits: int | None = None
    prefix_queries: int | None = None


def read(engine: AsyncEngine | DataParallelEngine) -> Reading:
    """The engine's reading; a data-parallel engine's sums its replicas' prefix-cache counts."""
    managers = [r.scheduler.block_manager for r in replicas(engine) if r.scheduler is not None]
    managers = [bm for bm in managers if bm is not None]
    if not managers or not all(bm.enable_prefix_caching for bm in managers):
        return Reading(engine.stats.snapshot())
    hits, queries = sum(bm.prefix_hits for bm in managers), sum(bm.prefix_queries for bm in managers)
    return Reading(engine.stats.snapshot(), hits, queries)


def replicas(engine: AsyncEngine | DataParallelEngine) -> list[AsyncEngine]:
    return engine.replicas if isinstance(engine, DataParallelEngine) else [engine]


def throughput_line(prev: Reading, cur: Reading) -> str | None:
    """vLLM's periodic line over the interval prev..cur; None when the engine was idle all along."""
    a, b = prev.stats, cur.stats
    seconds = max(b.time - a.time, 1e-9)
    prompt, generated = b.prompt_tokens - a.prompt_tokens, b.generation_tokens - a.generation_tokens
    if not (prompt or generated or b.running or b.waiting):
        return None
    line = (
        f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, Avg generation throughput: "
        f"{generated / seconds:.1f} tokens/s, Running: {b.running} seqs, Waiting: {b.waiting} seqs, "
        f"KV cache usage: {100 * b.kv_usage:.1f}%"
    )
    if cur.prefix_queries is not None and prev.prefix_queries is not None:
        queries = cur.prefix_queries - prev.prefix_queries
        if queries > 0:  # prompts were matched against the cache in this interval
            line += f", Prefix cache hit rate: {100 * (cur.prefix_hits - prev.prefix_hits) / queries:.1f}%"
    return line


async def log_stats(
    current: Callable[[], AsyncEngine | None], interval_s: float = DEFAULT_INTERVAL_S
) -> None:
    """Logs throughput_line every `interval_s` while busy; `current` gives the served engine (it changes
    when --restart-workers starts a new one, whose counters start from zero). Runs until cancelled."""
    prev: tuple[AsyncEngine, Reading] | None = None
    while True:
        engine = current()
        if engine is None or any(r.scheduler is None for r in replicas(engine)):
            prev = None
        else:
            try:
                reading = read(engine)
                line = throughput_line(prev[1], reading) if prev is not None and prev[0] is engine else None
            except Exception:  # noqa: BLE001 (a log line is never worth the server: skip this one)
                logger.debug("cannot read the engine's stats", exc_info=True)
                prev = None
            else:
                if line is not None:
                    logger.info("%s", line)
                prev = (engine, reading)
        await asyncio.sleep(interval_s)
