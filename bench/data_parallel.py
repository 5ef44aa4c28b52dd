#!/usr/bin/env python
"""Data-parallel replicas on one event loop: does the serving process keep up as N grows?

    python bench/data_parallel.py                    # N = 1 and 2, 64 and 256 requests per replica
    python bench/data_parallel.py --dp 1 2 4 --batches 64

The null model (bench/common.py: hidden 8, 2 layers; its forward costs microseconds) makes the
engine's own work the bottleneck. Each run starts a DataParallelEngine (N = 1: a plain AsyncEngine) of
N replicas with one worker each, submits B requests per replica (8-token prompts, `--steps` tokens
each, EOS ignored) at once and measures, side by side in one run:

* aggregate decode tokens/s, and its ratio to N = 1 at the same per-replica batch;
* engine-process CPU per step per replica: this process's CPU seconds (all threads: the loop, ZeroMQ's
  I/O thread) over the steps all replicas ran;
* loop busy share: engine CPU seconds / wall seconds; near 1.0 the one loop is the bottleneck and each
  replica's loop would need its own process.
On a 2-core machine N = 2 puts two workers and the engine process on two cores, so read the CPU per
step (which contention inflates only a little) before the tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import asyncengine  # noqa: F401  (the installed package first)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, build_model, load_line, machine_info, table, write_json  # noqa: E402

PROMPT_LEN = 8


async def run_one(model: Path, dp: int, batch: int, steps: int) -> dict[str, Any]:
    from asyncengine import EngineConfig, SamplingParams
    from asyncengine.dp_engine import start_engine

    blocks_per_seq = -(-(PROMPT_LEN + steps + 8) // 16)
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        num_threads=1,
        data_parallel_size=dp,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * PROMPT_LEN),
        num_kv_blocks=batch * blocks_per_seq + 64,
        enable_prefix_caching=False,
        max_model_len=PROMPT_LEN + steps + 64,
    )
    engine = await start_engine(config)
    replicas = getattr(engine, "replicas", [engine])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)

        async def one(i: int) -> int:
            prompt = [(7 * i + j) % 250 + 3 for j in range(PROMPT_LEN)]
            n = 0
            async for out in engine.generate(prompt, params):
                n = len(out.outputs[0].token_ids)
            return n

        await asyncio.gather(*(one(i) for i in range(4)))  # warm-up
        steps_before = [_steps(r) for r in replicas]
        cpu0, t0 = time.process_time(), time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(batch * dp))))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        ran = sum(_steps(r) - b for r, b in zip(replicas, steps_before))
    finally:
        await engine.shutdown()
    return {
        "dp": dp,
        "batch_per_replica": batch,
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "steps": ran,
        "engine_cpu_s": cpu,
        "cpu_us_per_step_per_replica": 1e6 * cpu / max(ran, 1),
        "loop_busy": cpu / wall,
    }


def _steps(engine: Any) -> int:
    return int(engine.stats.steps.collect()[0].samples[0].value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="requests per replica")
    p.add_argument("--steps", type=int, default=200, help="tokens per request")
    p.add_argument("--out", type=Path, default=OUT / "data_parallel.json")
    args = p.parse_args(argv)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    model = build_model("null")
    info0 = machine_info()
    results = [runner(run_one(model, dp, b, args.steps)) for b in args.batches for dp in args.dp]
    info1 = machine_info()
    print(f"\nnull model, {args.steps} tokens per request, one worker per replica, one torch thread each")
    print(f"start: {load_line(info0)}\nend:   {load_line(info1)}\n")
    base = {r["batch_per_replica"]: r["tok_per_s"] for r in results if r["dp"] == 1}
    rows = [
        [
            f"N={r['dp']} B={r['batch_per_replica']}/replica",
            r["tok_per_s"],
            r["tok_per_s"] / base[r["batch_per_replica"]] if r["batch_per_replica"] in base else None,
            r["steps"],
            r["cpu_us_per_step_per_replica"],
            r["loop_busy"],
        ]
        for r in results
    ]
    headers = ["config", "tok/s", "÷ N=1", "steps", "engine CPU µs / step / replica", "loop busy"]
    print(table(headers, rows, 2))
    write_json(args.out, {"machine_start": info0, "machine_end": info1, "results": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
