#!/usr/bin/env python
"""Control-plane cost: the same engine with a near-null forward, so the scheduler, the wire and the
event loop are all that is left to measure.

    python bench/control_plane.py --quick          # batch 1 and 64, P=1, few steps
    python bench/control_plane.py                  # batch 1, 64, 256; P=1 and P=2
    python bench/control_plane.py --py-spy         # plus an extra run at the largest batch under py-spy
    python bench/control_plane.py --backend mp ray --pp 1 --batches 256   # the Ray executor beside mp

The "null" model is a seeded random Llama with hidden 8, two layers, one head, vocab 256 (bench/common.py,
built into bench/out/models/null): its forward costs microseconds, so a step's time is the control
plane's. B requests with 8-token prompts and EOS ignored are submitted at once; after one prefill step
they decode in lockstep, one token each per step. Only steps holding exactly the decode batch are
counted (with P=2 the scheduler splits the B sequences into two batches of B/2 in flight).

Measured per (P, B), all from the engine side, nothing added to the engine (the bench wraps a few of
the engine's methods in this process):
* decode steps/s and tokens/s (steady state);
* worker idle gap between steps = (time between consecutive ModelOutputs at the engine) - (the
  worker's ModelOutput.execute_us): what the worker waits for the engine, the wire and its own decode;
* engine time per step: schedule(), _send() (build the ExecuteModelRequest, encode, zmq send) and
  _process() (tokens to requests, stop checks, detokenize, queue puts);
* ExecuteModelRequest bytes per step;
* in-process codec timings (transport.codec.engine_codec) of a decode-step ExecuteModelRequest for the
  same batch sizes: encode and decode µs, bytes; and of the ModelOutput coming back.
The engine runs on uvloop, as `asyncengine serve` does. Writes bench/out/control_plane.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

import asyncengine  # noqa: F401  (the installed package first)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    OUT,
    apply_quick,
    bar_plot,
    build_model,
    load_line,
    machine_info,
    median,
    percentile,
    table,
    write_json,
)

PROMPT_LEN = 8


def codec_timings(batch: int, reps: int) -> dict[str, float]:
    """Encode/decode of one decode step's ExecuteModelRequest (a CachedSeq per sequence, one new token,
    a new block id for 1 in 16 of them, as every 16th step brings) and of its ModelOutput."""
    from asyncengine.transport.codec import engine_codec, worker_codec
    from asyncengine.transport.wire import CachedSeq, ExecuteModelRequest, ModelOutput, pack_ids

    ec, wc = engine_codec(), worker_codec()
    req = ExecuteModelRequest(
        12345,
        [],
        [CachedSeq(1000 + i, 1, [17 + i % 200], [5000 + i] if i % 16 == 0 else []) for i in range(batch)],
        [],
    )
    out = ModelOutput(12345, pack_ids([17 + i % 200 for i in range(batch)]), [], 1234)

    def best(fn: Any) -> float:  # median of `reps` runs, µs
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            fn()
            ts.append((time.perf_counter_ns() - t0) / 1e3)
        return median(ts)

    data, odata = ec.encode(req), wc.encode(out)
    return {
        "req_bytes": len(data),
        "req_encode_us": best(lambda: ec.encode(req)),
        "req_decode_us": best(lambda: ec.decode(data)),
        "out_bytes": len(odata),
        "out_encode_us": best(lambda: wc.encode(out)),
        "out_decode_us": best(lambda: wc.decode(odata)),
    }


class Probe:
    """Wraps the engine's schedule / _send / _process / recv_output (instance attributes, this process
    only) and records per-step timings."""

    def __init__(self, engine: Any) -> None:
        self.arrivals: list[tuple[float, int, int]] = []  # (perf_counter at arrival, execute_us, step_id)
        self.sched_us: list[float] = []
        self.send_us: list[float] = []
        self.process_us: list[float] = []
        self.step_size: dict[int, tuple[int, bool]] = {}  # step_id -> (num seqs, decode only)
        self.step_bytes: dict[int, int] = {}
        self._wrap(engine)

    def _wrap(self, engine: Any) -> None:
        sched, send, process, recv = (
            engine.scheduler.schedule,
            engine._send,
            engine._process,
            engine.executor.recv_output,
        )
        executor = engine.executor

        def schedule() -> Any:
            t0 = time.perf_counter()
            out = sched()
            if out.scheduled:
                self.sched_us.append((time.perf_counter() - t0) * 1e6)
            return out

        def _send(s: Any) -> None:
            t0 = time.perf_counter()
            send(s)
            self.send_us.append((time.perf_counter() - t0) * 1e6)
            step_id = engine._in_flight[-1].step_id
            self.step_size[step_id] = (
                len(s.scheduled),
                all(x[1] == 1 for x in s.scheduled),
            )  # (seq, num_tokens, ...)
            self.step_bytes[step_id] = executor.last_encode_bytes

        def _process(output: Any) -> None:
            t0 = time.perf_counter()
            process(output)
            self.process_us.append((time.perf_counter() - t0) * 1e6)

        async def recv_output(timeout_s: float) -> Any:
            msg = await recv(timeout_s)
            self.arrivals.append((time.perf_counter(), msg.execute_us, msg.step_id))
            return msg

        engine.scheduler.schedule = schedule
        engine._send = _send
        engine._process = _process
        executor.recv_output = recv_output


def py_spy(pid: int, out: Path) -> subprocess.Popen | None:
    try:
        return subprocess.Popen(
            ["py-spy", "record", "-p", str(pid), "-o", str(out), "-f", "raw", "-r", "250", "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except FileNotFoundError:
        print("py-spy not installed (pip install py-spy): no profile", file=sys.stderr)
        return None


def top_frames(raw: Path, n: int = 12) -> list[tuple[float, str]]:
    """Self-time shares of the hottest frames in a py-spy raw (collapsed stacks) file."""
    counts: dict[str, int] = {}
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for line in raw.read_text().splitlines():
            stack, _, num = line.rpartition(" ")
            k = int(num)
            total += k
            leaf = stack.split(";")[-1]
            counts[leaf] = counts.get(leaf, 0) + k
    return [(v / total, k) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:n]] if total else []


async def run_one(
    model: Path, pp: int, batch: int, steps: int, args: argparse.Namespace, profile: bool, backend: str = "mp"
) -> dict[str, Any]:
    from asyncengine import AsyncEngine, EngineConfig, SamplingParams

    blocks_per_seq = -(-(PROMPT_LEN + steps + 8) // 16)
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        pipeline_parallel_size=pp,
        num_threads=1,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch * PROMPT_LEN),
        num_kv_blocks=batch * blocks_per_seq + 64,
        enable_prefix_caching=False,
        max_model_len=PROMPT_LEN + steps + 64,
        step_timeout=30.0,
        distributed_executor_backend=backend,
    )
    started = time.perf_counter()
    engine = await AsyncEngine.start(config)  # with ray: its own local Ray instance, started here
    start_s = time.perf_counter() - started
    profs: list[tuple[str, subprocess.Popen, Path]] = []
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        await asyncio.gather(*[_drain(engine, [3 + i] * PROMPT_LEN, warm) for i in range(min(batch, 4))])
        probe = Probe(engine)
        if profile:
            for name, pid in [
                ("engine", os.getpid()),
                *[(f"worker{i}", p.pid) for i, p in enumerate(engine.executor.procs)],
            ]:
                f = OUT / f"control_plane_prof_{name}_p{pp}_b{batch}.txt"
                proc = py_spy(pid, f)
                if proc is not None:
                    profs.append((name, proc, f))
            await asyncio.sleep(1.0)  # py-spy attaches
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        t0 = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(
                *[
                    _drain(engine, [(7 * i + j) % 250 + 3 for j in range(PROMPT_LEN)], params)
                    for i in range(batch)
                ]
            ),
            args.timeout,
        )
        wall = time.perf_counter() - t0
    finally:
        for _, proc, _ in profs:
            proc.send_signal(2)  # SIGINT: py-spy writes its file
        for _, proc, _ in profs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        await engine.shutdown()

    # steady state: decode-only steps of the full batch (B, or B/P with P batches in flight)
    per_batch = -(-batch // pp)
    arr = probe.arrivals
    intervals, gaps, execs, nbytes = [], [], [], []
    for (t_prev, _, _), (t, ex, sid) in zip(arr, arr[1:]):
        size, decode = probe.step_size.get(sid, (0, False))
        if decode and size >= per_batch - (1 if pp > 1 else 0):
            intervals.append((t - t_prev) * 1e6)
            execs.append(ex)
            gaps.append((t - t_prev) * 1e6 - ex)
            nbytes.append(probe.step_bytes[sid])
    skip = min(3, len(intervals) // 4)
    intervals, gaps, execs, nbytes = intervals[skip:], gaps[skip:], execs[skip:], nbytes[skip:]
    med = median(intervals)
    res = {
        "backend": backend,
        "start_s": start_s,
        "pp": pp,
        "batch": batch,
        "steps": steps,
        "wall_s": wall,
        "decode_steps": len(intervals),
        "steps_per_s": 1e6 / med if intervals else None,
        "tok_per_s": per_batch * 1e6 / med if intervals else None,
        "interval_us_p50": med,
        "interval_us_p90": percentile(intervals, 90),
        "execute_us_p50": median(execs),
        "idle_gap_us_p50": median(gaps),
        "idle_gap_us_p90": percentile(gaps, 90),
        "idle_share": median(gaps) / med if intervals else None,
        "schedule_us_p50": median(probe.sched_us),
        "send_us_p50": median(probe.send_us),
        "process_us_p50": median(probe.process_us),
        "req_bytes_p50": median(nbytes),
    }
    if profs:
        res["profiles"] = {name: [(round(s, 3), k) for s, k in top_frames(f)] for name, _, f in profs}
    return res


async def _drain(engine: Any, prompt: list[int], params: Any) -> int:
    n = 0
    async for out in engine.generate(prompt, params):
        n = len(out.outputs[0].token_ids)
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument(
        "--pp", type=int, nargs="+", default=[1, 2], help="pipeline sizes (P=2 shares the 2 cores)"
    )
    p.add_argument("--steps", type=int, default=300, help="decode steps per run")
    p.add_argument(
        "--backend", nargs="+", default=["mp"], choices=["mp", "ray"], help="executor backends, side by side"
    )
    p.add_argument("--codec-reps", type=int, default=2000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    p.add_argument("--py-spy", action="store_true", help="profile engine + workers at the largest batch, P=1")
    p.add_argument("--quick", action="store_true", help="batch 1 and 64, P=1, 60 steps")
    p.add_argument("--out", type=Path, default=OUT / "control_plane.json")
    args = p.parse_args(argv)
    if args.quick:
        apply_quick(args, p, {"batches": [1, 64], "pp": [1], "steps": 60, "codec_reps": 300})
    faulthandler.dump_traceback_later(args.timeout * len(args.batches) * len(args.pp) + 300, exit=True)
    model = build_model("null")
    info0 = machine_info()
    print(f"{info0['date_utc']}  {load_line(info0)}", file=sys.stderr)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run

    codec = {b: codec_timings(b, args.codec_reps) for b in args.batches}
    runs = [(be, pp, b) for be in args.backend for pp in args.pp for b in args.batches if b >= pp]
    results = []
    if args.py_spy:
        # an extra, profiled run: py-spy perturbs it, so it is not in the table
        runs.append((args.backend[0], 1, max(args.batches)))
    profiled: dict[str, Any] | None = None
    for k, (be, pp, b) in enumerate(tqdm(runs, desc="control plane", unit="run")):
        profile = args.py_spy and k == len(runs) - 1
        try:
            r = runner(run_one(model, pp, b, args.steps, args, profile, be))
        except Exception as e:
            print(f"\n{be} P={pp} B={b} failed: {type(e).__name__}: {e}", file=sys.stderr)
            r = {"backend": be, "pp": pp, "batch": b, "error": f"{type(e).__name__}: {e}"}
        if profile:
            profiled = r
        else:
            results.append(r)
    info1 = machine_info()

    print(
        f"\nnull model (hidden 8, 2 layers, vocab 256), {args.steps} decode steps, 1 torch thread per worker"
    )
    print(f"start: {load_line(info0)}\nend:   {load_line(info1)}\n")
    rows = []
    for r in results:
        b1 = next(
            (
                x
                for x in results
                if x.get("batch") == 1
                and x.get("pp") == 1
                and x["backend"] == r["backend"]
                and "error" not in x
            ),
            None,
        )
        label = f"{r['backend']} P={r['pp']} B={r['batch']}"
        if "error" in r:
            rows.append([label, r["error"][:40]] + [None] * 12)
            continue
        rows.append(
            [
                label,
                r["start_s"],
                r["steps_per_s"],
                r["tok_per_s"],
                r["tok_per_s"] / b1["tok_per_s"] if b1 else None,
                r["interval_us_p50"],
                r["execute_us_p50"],
                r["idle_gap_us_p50"],
                r["idle_gap_us_p90"],
                100 * r["idle_share"],
                r["schedule_us_p50"],
                r["send_us_p50"],
                r["process_us_p50"],
                r["req_bytes_p50"],
            ]
        )
    print(
        table(
            [
                "config",
                "engine start s",
                "steps/s",
                "tok/s",
                "tok/s ÷ P=1 B=1",
                "step µs p50",
                "worker execute µs",
                "idle gap µs p50",
                "idle gap µs p90",
                "idle % of step",
                "schedule µs",
                "_send µs",
                "_process µs",
                "req bytes",
            ],
            rows,
            1,
        )
    )
    print("\nin-process codec (engine_codec / worker_codec), one decode step")
    print(
        table(
            [
                "batch",
                "ExecuteModelRequest bytes",
                "encode µs",
                "decode µs",
                "ModelOutput bytes",
                "encode µs",
                "decode µs",
            ],
            [
                [
                    b,
                    c["req_bytes"],
                    c["req_encode_us"],
                    c["req_decode_us"],
                    c["out_bytes"],
                    c["out_encode_us"],
                    c["out_decode_us"],
                ]
                for b, c in codec.items()
            ],
            1,
        )
    )
    if profiled is not None and "error" not in profiled:
        print(
            f"\nprofiled extra run P=1 B={profiled['batch']} (py-spy running, so slower): step µs p50 "
            f"{profiled['interval_us_p50']:.0f}, _send µs {profiled['send_us_p50']:.0f}, _process µs "
            f"{profiled['process_us_p50']:.0f}, worker execute µs {profiled['execute_us_p50']:.0f}"
        )
        for name, frames in profiled.get("profiles", {}).items():
            print(f"py-spy self time, {name} (share of non-idle samples):")
            for share, frame in frames:
                print(f"  {share:6.1%}  {frame[:120]}")
    write_json(
        args.out,
        {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine_start": info0,
            "machine_end": info1,
            "codec": codec,
            "results": results,
            "profiled_run": profiled,
        },
    )
    ok = [r for r in results if "error" not in r]
    png = bar_plot(
        args.out.with_suffix(".png"),
        f"null-model step time breakdown (load {info0['loadavg'][0]:.1f})",
        [f"{r['backend']} P={r['pp']} B={r['batch']}" for r in ok],
        {
            "worker execute µs": [r["execute_us_p50"] for r in ok],
            "idle gap µs": [r["idle_gap_us_p50"] for r in ok],
            "engine _send µs": [r["send_us_p50"] for r in ok],
            "engine _process µs": [r["process_us_p50"] for r in ok],
        },
        "µs per step (median)",
        log=True,
    )
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
