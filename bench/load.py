#!/usr/bin/env python
"""Load: thousands of concurrent streams against one `asyncengine serve` on loopback, checked delta by delta.

    python bench/load.py --quick            # 100 streams per phase
    python bench/load.py                    # 1,000 streams per phase
    python bench/load.py --streams 2000 --ws-connections 200

Phases, one after another against the same server (the bundled default model: a small Llama with a
real tokenizer, so every delta is detokenized text):
  ws-mux    N websocket streams multiplexed over --ws-connections connections (N / C per connection)
  ws-conn   N websocket connections, one stream each
  http-sse  N concurrent POST /v1/completions with stream=true (one HTTP connection each)
All N streams of a phase are sent at once. Every stream is greedy with EOS ignored and a distinct
prompt; its expected text and token ids come from the in-process `LLM` run before the server starts.

Per phase: failures (error frames/events, HTTP errors, timeouts, missing `done`/[DONE], short output),
lost-or-duplicated deltas (a stream whose concatenated deltas differ from the in-process result, or
with frames after its end), wall time, output tokens/s, stream latency p50/p99, and the RSS of the
server and its workers (/proc/PID/status VmRSS summed): before, peak during, and after the phase once
the engine is idle again. The baseline is taken after a small warm-up (32 streams). The phases run
--rounds times (default 2): the first round lifts RSS to the allocators' high-water mark, so the leak
check is the growth from the end of round 1 to the end of the last round. Also checks the server's
/metrics at the end: no running request and every KV block free. Writes bench/out/load.json; exits 1
on any failure or lost/duplicated delta.

The script raises its RLIMIT_NOFILE soft limit to the hard one (each connection is a descriptor here
and in the server, which inherits the raised limit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    OUT,
    apply_quick,
    load_line,
    machine_info,
    percentile,
    started,
    table,
    wait_for_line,
    write_json,
)

SNIPPETS = [
    "def {name}(n):\n    ",
    'import os\n\n\ndef {name}(path):\n    """',
    "class {Name}:\n    def __init__(self",
    "for i in range({n}):\n    ",
    "# {name}: sort the list\ndef {name}(items):\n",
    "x = [{n}, {m}, 3]\nprint(",
    "def test_{name}():\n    assert ",
    "with open('{name}.txt') as f:\n    ",
]


def prompts(n: int) -> list[str]:
    """n distinct prompts, so a delta delivered to the wrong stream would show."""
    out = []
    for i in range(n):
        name = f"f{i}_" + "abcdefghij"[i % 10] * (1 + i % 3)
        out.append(SNIPPETS[i % len(SNIPPETS)].format(name=name, Name=name.title(), n=i, m=i * 7 % 101))
    return out


@dataclass
class Expected:
    text: str
    token_ids: list[int]


@dataclass
class Stream:
    """One stream as the client saw it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    usage_tokens: int | None = None
    finish_reason: str | None = None
    ended: bool = False  # `done` frame / [DONE] seen
    after_end: int = 0  # frames for this stream after its end: duplicates
    error: str | None = None
    sent: float = 0.0
    end: float = 0.0


# -- memory -----------------------------------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [c for c, p in parents.items() if p == parent]
        found += kids
        frontier += kids
    return found


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
        except OSError:
            continue
        total += int(m.group(1)) if m else 0
    return total / 1024


class RssSampler:
    """Samples the server's RSS every `period_s` while a phase runs; keeps the peak."""

    def __init__(self, pids: list[int], period_s: float = 0.2) -> None:
        self.pids, self.period_s, self.peak = pids, period_s, 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mib(self.pids))
            await asyncio.sleep(self.period_s)

    def __enter__(self) -> RssSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.peak = max(self.peak, rss_mib(self.pids))


# -- clients ----------------------------------------------------------------------------------------
def generate_frame(rid: str, prompt: str, max_tokens: int) -> str:
    return json.dumps(
        {
            "type": "generate",
            "request_id": rid,
            "prompt": prompt,
            "params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        }
    )


async def ws_connection(
    url: str, items: list[tuple[int, str]], max_tokens: int, results: list[Stream], timeout_s: float
) -> None:
    """Runs `items` (stream index, prompt) as concurrent streams on one connection."""
    streams = {str(i): results[i] for i, _ in items}
    try:
        async with asyncio.timeout(timeout_s):
            async with connect(url, open_timeout=timeout_s, max_size=2**24, ping_interval=None) as ws:
                for i, prompt in items:
                    results[i].sent = time.perf_counter()
                    await ws.send(generate_frame(str(i), prompt, max_tokens))
                await ws_read(ws, streams)
    except Exception as e:  # a timeout or a dropped connection fails the streams still open
        for s in streams.values():
            if not s.ended and s.error is None:
                s.error = f"{type(e).__name__}: {e}"[:200]


async def ws_read(ws: ClientConnection, streams: dict[str, Stream]) -> None:
    open_ = len(streams)
    while open_:
        frame = json.loads(await ws.recv())
        s = streams.get(frame.get("request_id") or "")
        if s is None:
            raise RuntimeError(f"frame for an unknown stream: {frame}")
        if s.ended or s.error is not None:
            s.after_end += 1
            continue
        kind = frame["type"]
        if kind == "delta":
            s.text += frame["text"]
            s.token_ids += frame["token_ids"]
            continue
        s.end = time.perf_counter()
        open_ -= 1
        if kind == "done":
            s.ended, s.finish_reason = True, frame["finish_reason"]
            s.usage_tokens = frame["usage"]["completion_tokens"]
        else:
            s.error = f"{frame.get('code')}: {frame.get('message')}"[:200]
    try:  # anything more on this connection within a moment is a duplicate
        async with asyncio.timeout(0.05):
            while True:
                frame = json.loads(await ws.recv())
                streams[frame["request_id"]].after_end += 1
    except (TimeoutError, KeyError):
        pass


async def sse_stream(
    http: httpx.AsyncClient, prompt: str, max_tokens: int, s: Stream, timeout_s: float
) -> None:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    s.sent = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s), http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if s.ended:
                    s.after_end += 1
                    continue
                if data == "[DONE]":
                    s.ended = True
                    continue
                msg = json.loads(data)
                if "error" in msg:
                    s.error = str(msg["error"])[:200]
                    return
                for choice in msg.get("choices") or []:
                    s.text += choice.get("text") or ""
                    if choice.get("finish_reason"):
                        if s.finish_reason is not None:
                            s.after_end += 1
                        s.finish_reason = choice["finish_reason"]
                if msg.get("usage"):
                    s.usage_tokens = msg["usage"]["completion_tokens"]
    except Exception as e:
        s.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        s.end = time.perf_counter()


# -- phases -----------------------------------------------------------------------------------------
async def run_phase(
    name: str, base: str, ws_url: str, texts: list[str], expected: list[Expected], args: Any, pids: list[int]
) -> dict[str, Any]:
    n = len(texts)
    results = [Stream() for _ in range(n)]
    before = rss_mib(pids)
    t0 = time.perf_counter()
    with RssSampler(pids) as sampler:
        if name == "ws-mux":
            c = max(1, min(args.ws_connections, n))
            groups = [[(i, texts[i]) for i in range(k, n, c)] for k in range(c)]
            await asyncio.gather(
                *(ws_connection(ws_url, g, args.max_tokens, results, args.timeout) for g in groups)
            )
        elif name == "ws-conn":
            await asyncio.gather(
                *(
                    ws_connection(ws_url, [(i, texts[i])], args.max_tokens, results, args.timeout)
                    for i in range(n)
                )
            )
        else:
            limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
            async with httpx.AsyncClient(base_url=base, limits=limits, timeout=args.timeout) as http:
                await asyncio.gather(
                    *(sse_stream(http, texts[i], args.max_tokens, results[i], args.timeout) for i in range(n))
                )
    wall = time.perf_counter() - t0
    await engine_idle(base, args.num_kv_blocks, args.timeout)
    await asyncio.sleep(args.settle)
    after = rss_mib(pids)
    return summarize(name, results, expected, args, wall, before, sampler.peak, after)


def summarize(
    name: str,
    results: list[Stream],
    expected: list[Expected],
    args: Any,
    wall: float,
    before: float,
    peak: float,
    after: float,
) -> dict[str, Any]:
    failures, wrong, dups, examples = 0, 0, 0, []
    for i, (s, want) in enumerate(zip(results, expected)):
        failed = (
            s.error is not None
            or not s.ended
            or s.finish_reason != "length"
            or s.usage_tokens != args.max_tokens
        )
        failures += failed
        dups += s.after_end
        mismatch = not failed and (
            s.text != want.text or (name.startswith("ws") and s.token_ids != want.token_ids)
        )
        wrong += mismatch or (s.after_end > 0)
        if (failed or mismatch) and len(examples) < 5:
            examples.append(
                {
                    "stream": i,
                    "error": s.error,
                    "ended": s.ended,
                    "finish_reason": s.finish_reason,
                    "usage_tokens": s.usage_tokens,
                    "got": s.text,
                    "want": want.text,
                }
            )
    latencies = [s.end - s.sent for s in results if s.error is None and s.ended]
    tokens = sum(s.usage_tokens or 0 for s in results)
    return {
        "phase": name,
        "streams": len(results),
        "failures": failures,
        "lost_or_duplicated": wrong,
        "frames_after_end": dups,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "latency_p50_s": percentile(latencies, 50) if latencies else None,
        "latency_p99_s": percentile(latencies, 99) if latencies else None,
        "rss_before_mib": before,
        "rss_peak_mib": peak,
        "rss_after_mib": after,
        "examples": examples,
    }


async def metrics(base: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{base}/metrics")).text
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_free_blocks"):
        m = re.search(rf"^asyncengine:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)  # any labels (model_name)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


async def engine_idle(base: str, num_blocks: int, timeout_s: float) -> dict[str, float]:
    """Waits until no request runs or waits and every KV block is free again (all streams were released)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await metrics(base)
        idle = m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
        if (idle and m["kv_cache_free_blocks"] == num_blocks) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.2)


# -- main -------------------------------------------------------------------------------------------
def expected_outputs(args: Any, texts: list[str]) -> list[Expected]:
    """The in-process result of every prompt (same engine settings as the server), then the LLM is gone."""
    from asyncengine import LLM, SamplingParams

    llm = LLM(
        model=args.model, dtype="float32", num_kv_blocks=args.num_kv_blocks, num_threads=args.num_threads
    )
    try:
        outs = llm.generate(
            texts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        )
    finally:
        llm.shutdown()
    return [Expected(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def drive(
    args: Any, base: str, ws_url: str, pids: list[int], texts: list[str], expected: list[Expected]
) -> dict[str, Any]:
    # warm-up (lazy imports, buffers, the first connections), then the baseline
    warm = min(32, len(texts))
    for name in ("ws-mux", "http-sse"):
        await run_phase(name, base, ws_url, texts[:warm], expected[:warm], args, pids)
    await engine_idle(base, args.num_kv_blocks, args.timeout)
    await asyncio.sleep(args.settle)
    baseline, baseline_each = rss_mib(pids), {pid: rss_mib([pid]) for pid in pids}
    phases, after_round = [], []
    for r in range(args.rounds):
        for name in args.phases:
            phase = await run_phase(name, base, ws_url, texts, expected, args, pids)
            phases.append(phase | {"phase": f"{name}" + (f" #{r + 1}" if args.rounds > 1 else "")})
        after_round.append(phases[-1]["rss_after_mib"])
    final = await engine_idle(base, args.num_kv_blocks, args.timeout)
    await asyncio.sleep(args.settle)
    return {
        "baseline_rss_mib": baseline,
        "final_rss_mib": rss_mib(pids),
        "rss_after_round_mib": after_round,
        "final_metrics": final,
        "rss_by_pid_mib": {pid: [baseline_each[pid], rss_mib([pid])] for pid in pids},
        "phases": phases,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000, help="concurrent streams per phase")
    parser.add_argument(
        "--quick", action="store_true", help="100 streams per phase, 10 websocket connections"
    )
    parser.add_argument("--ws-connections", type=int, default=100, help="connections of the ws-mux phase")
    parser.add_argument(
        "--phases",
        nargs="+",
        default=["ws-mux", "ws-conn", "http-sse"],
        choices=["ws-mux", "ws-conn", "http-sse"],
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="run the phases this many times (RSS that stops growing is the allocator's high-water "
        "mark, not a leak)",
    )
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--model", default=None, help="model directory (default: the bundled default model)")
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch threads per worker (1: on a shared CPU, more threads only contend)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a phase may take")
    parser.add_argument(
        "--settle", type=float, default=2.0, help="idle seconds before an 'after' RSS reading"
    )
    parser.add_argument("--out", type=Path, default=OUT / "load.json")
    args = parser.parse_args()
    if args.quick:
        apply_quick(args, parser, {"streams": 100, "ws_connections": 10})
    if args.model is None:
        from asyncengine.config import default_model_path

        args.model = default_model_path()
    fds = raise_fd_limit()
    need = 2 * args.streams + 256  # ws-conn: one descriptor per connection here and one in the server
    if fds < need:
        print(f"RLIMIT_NOFILE is {fds}; {need} needed: lower --streams", file=sys.stderr)
        return 2
    info = machine_info()
    print(
        f"load: {args.streams} streams x {len(args.phases)} phases, {args.max_tokens} tokens each; "
        f"{load_line(info)}",
        flush=True,
    )
    texts = prompts(args.streams)
    t0 = time.perf_counter()
    expected = expected_outputs(args, texts)
    print(f"in-process reference: {len(expected)} completions in {time.perf_counter() - t0:.1f}s", flush=True)

    log = OUT / "load_server.log"
    cmd = [
        sys.executable,
        "-m",
        "asyncengine",
        "serve",
        "--model",
        args.model,
        "--port",
        "0",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--num-threads",
        str(args.num_threads),
        "--max-live-requests",
        str(max(4096, 2 * args.streams)),
        "--log-level",
        "warning",
    ]
    with started(cmd, log=log, cwd=OUT) as proc:
        line, _ = wait_for_line(proc, "asyncengine serving", 300, log=log)
        host_port = re.search(r"http://(\S+?) ", line)
        assert host_port, line
        base, ws_url = f"http://{host_port.group(1)}", f"ws://{host_port.group(1)}/v1/ws"
        pids = [proc.pid, *descendants(proc.pid)]
        result = asyncio.run(drive(args, base, ws_url, pids, texts, expected))
    rows = [
        [
            p["phase"],
            p["streams"],
            p["failures"],
            p["lost_or_duplicated"],
            p["wall_s"],
            p["tokens_per_s"],
            p["latency_p50_s"],
            p["latency_p99_s"],
            p["rss_before_mib"],
            p["rss_peak_mib"],
            p["rss_after_mib"],
        ]
        for p in result["phases"]
    ]
    headers = [
        "phase",
        "streams",
        "failures",
        "lost/dup",
        "wall s",
        "tok/s",
        "p50 s",
        "p99 s",
        "RSS before MiB",
        "RSS peak MiB",
        "RSS after MiB",
    ]
    print(table(headers, rows, digits=1))
    base_rss, final_rss = result["baseline_rss_mib"], result["final_rss_mib"]
    rounds = result["rss_after_round_mib"]
    print(
        f"RSS after each round: {', '.join(f'{x:.0f}' for x in rounds)} MiB; growth after the first round "
        f"{rounds[-1] - rounds[0]:+.0f} MiB (a leak grows every round; the first round's rise is high-water)"
    )
    print(
        f"RSS (server + workers): baseline {base_rss:.0f} MiB after warm-up, final {final_rss:.0f} MiB "
        f"({final_rss - base_rss:+.0f} MiB); by process (pid: baseline, final): {result['rss_by_pid_mib']}; "
        f"server at the end: {result['final_metrics']}"
    )
    for p in result["phases"]:
        for ex in p["examples"]:
            print(f"  {p['phase']} example: {ex}")
    write_json(
        args.out,
        {
            "machine": info,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "headers": headers,
            "rows": rows,
            **result,
        },
    )
    print(f"wrote {args.out}")
    bad = sum(p["failures"] + p["lost_or_duplicated"] for p in result["phases"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
