#!/usr/bin/env python
"""Cold start: seconds from launching the server to the first streamed token, asyncengine vs vLLM.

    python bench/startup.py --quick              # asyncengine and vLLM once each
    python bench/startup.py                      # 3 repeats each, median
    python bench/startup.py --model tiny --repeats 5

The clock starts just before the server process is launched (`python -m asyncengine serve`, or vLLM's
OpenAI API server from bench/vllm_venv) on a free port and stops when the first SSE chunk of a
streamed one-token /v1/completions request arrives. The client polls from the start: connection
refused or 503 (asyncengine answers 503 while it loads) are retried every 20 ms. Both servers get the
same model (default: the bundled default model, a small Llama with a tokenizer), float32 and 2 threads.
Also reported for asyncengine: when it printed its "serving on" line, and the split of its start-up:
the server runs with ASYNCENGINE_STARTUP_TRACE=1, so the engine process and its rank-0 worker stamp
their milestones on stderr (asyncengine/startup_trace.py), and the table gives seconds from launch to
each milestone and the phases between them (medians over the launches). Every server is killed (its
whole process group) before the next launch. Writes bench/out/startup.json and bench/out/startup.png.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    OUT,
    apply_quick,
    bar_plot,
    free_port,
    load_line,
    machine_info,
    median,
    started,
    table,
    vllm_available,
    write_json,
)
from serving import resolve_model, server_command  # noqa: E402


def first_token(base_url: str, proc: Any, deadline: float) -> float:
    """perf_counter time of the first streamed chunk; polls until the server answers."""
    import httpx

    body = {
        "model": "bench",
        "prompt": [5, 6, 7, 8],
        "max_tokens": 1,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=httpx.Timeout(60.0, connect=2.0)) as client:
        while time.perf_counter() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}")
            try:
                with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
                    if r.status_code == 200:
                        for line in r.iter_lines():
                            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                                if json.loads(line[5:]).get("choices"):
                                    return time.perf_counter()
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    raise TimeoutError("no token before the deadline")


TRACE_PREFIX = b"asyncengine-startup "  # asyncengine/startup_trace.py
# milestones, in start-up order: "process event" as traced, and the name they get in the table
MILESTONES = [
    ("engine spawn", "engine: imported, spawns workers"),
    ("worker0 started", "worker: process up"),
    ("engine init-done", "engine: config + tokenizer read"),
    ("worker0 init-received", "worker: InitWorker received"),
    ("worker0 imported", "worker: torch + model code imported"),
    ("worker0 model-loaded", "worker: weights loaded"),
    ("worker0 kv-sized", "worker: KV cache sized"),
    ("engine cache-ready", "engine: KV cache allocated"),
    ("worker0 first-step-received", "worker: first step received"),
    ("worker0 first-step", "worker: first step done"),
]


def phases(at: dict[str, float], first_token_s: float) -> dict[str, float]:
    """The start-up split, in seconds: engine imports (launch to spawning the workers: the interpreter,
    imports, binding, the app), worker spawn (to the worker's serve loop), engine config + tokenizer,
    worker imports (torch and the model code, in the background from the worker's start), weight load
    (from when both InitWorker and the imports are there), KV set-up (sizing, allocation, graph
    capture), first step (the KV cache ready to the client's first token: readiness, the request, the
    first forward)."""
    if not all(k in at for k, _ in MILESTONES[:-2]):
        return {}
    load_from = max(at["worker0 init-received"], at["worker0 imported"])
    return {
        "engine imports": at["engine spawn"],
        "worker spawn": at["worker0 started"] - at["engine spawn"],
        "engine config + tokenizer": at["engine init-done"] - at["engine spawn"],
        "worker imports": at["worker0 imported"] - at["worker0 started"],
        "weight load": at["worker0 model-loaded"] - load_from,
        "KV set-up": at["engine cache-ready"] - at["worker0 model-loaded"],
        "first step": first_token_s - at["engine cache-ready"],
    }


def launch_once(kind: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    cmd, env = server_command(kind, model, port, args)
    if kind == "asyncengine":
        env = {**(env or os.environ), "ASYNCENGINE_STARTUP_TRACE": "1"}
    ready_at: list[float] = []
    marks: dict[str, float] = {}  # "process event" -> wall-clock time
    tail: deque[bytes] = deque(maxlen=40)  # the server's last output lines, reported if it fails
    t0_wall = time.time()
    t0 = time.perf_counter()
    with started(cmd, env=env, cwd=OUT) as proc:  # output on a pipe, drained by the thread below

        def drain() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                tail.append(raw)
                if raw.startswith(TRACE_PREFIX):
                    parts = raw.decode(errors="replace").split()
                    if len(parts) == 4:
                        marks.setdefault(f"{parts[2]} {parts[3]}", float(parts[1]))
                elif not ready_at and b"asyncengine serving" in raw:
                    ready_at.append(time.perf_counter())

        threading.Thread(target=drain, daemon=True).start()
        try:
            t_tok = first_token(f"http://127.0.0.1:{port}", proc, t0 + args.timeout)
        except Exception as e:
            time.sleep(0.2)  # the server's last words
            e.output_tail = [line.decode(errors="replace").rstrip() for line in tail]  # type: ignore[attr-defined]
            raise
        time.sleep(0.1)  # the worker's first-step line may trail the token by a moment
    first_token_s = t_tok - t0
    at = {k: round(v - t0_wall, 4) for k, v in marks.items()}
    return {
        "first_token_s": first_token_s,
        "ready_line_s": (ready_at[0] - t0) if ready_at else None,
        "milestones_s": at,
        "phases_s": phases(at, first_token_s),
    }


def split_tables(rs: list[dict[str, Any]]) -> str:
    """Medians over the launches of each milestone (seconds from launch) and of each phase."""
    ok = [r for r in rs if "error" not in r and r.get("phases_s")]
    if not ok:
        return ""
    rows = [
        [name, median([r["milestones_s"][k] for r in ok])]
        for k, name in MILESTONES
        if all(k in r["milestones_s"] for r in ok)
    ]
    rows.append(["client: first streamed token", median([r["first_token_s"] for r in ok])])
    out = table(["milestone", "s from launch (median)"], rows)
    out += "\n\n" + table(
        ["phase", "s (median)"], [[k, median([r["phases_s"][k] for r in ok])] for k in ok[0]["phases_s"]]
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default | tiny | medium | a model directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--servers", nargs="+", default=["asyncengine", "vllm"], choices=["asyncengine", "vllm"])
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds one launch may take to the first token"
    )
    p.add_argument("--quick", action="store_true", help="one launch per server")
    p.add_argument("--out", type=Path, default=OUT / "startup.json")
    args = p.parse_args(argv)
    if args.quick:
        apply_quick(args, p, {"repeats": 1})
    model = resolve_model(args.model)
    OUT.mkdir(parents=True, exist_ok=True)  # the servers' working directory
    kinds, notes = [], []
    for k in args.servers:
        if k == "vllm" and not vllm_available():
            notes.append("vLLM skipped: bench/vllm_venv is absent (bash bench/setup_vllm.sh)")
        else:
            kinds.append(k)
    faulthandler.dump_traceback_later(len(kinds) * args.repeats * (args.timeout + 30) + 120, exit=True)
    info0 = machine_info()
    print(f"{info0['date_utc']}  {load_line(info0)}", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    plan = [k for _ in range(args.repeats) for k in kinds]  # interleaved: drift hits both alike
    for kind in tqdm(plan, desc="startup", unit="launch"):
        try:
            runs[kind].append(launch_once(kind, model, args))
        except Exception as e:
            out_tail = getattr(e, "output_tail", [])
            print(f"\n{kind} launch failed: {type(e).__name__}: {e}", *out_tail, sep="\n", file=sys.stderr)
            runs[kind].append({"error": f"{type(e).__name__}: {e}"[:300], "output_tail": out_tail})
    info1 = machine_info()

    summary = {}
    for kind, rs in runs.items():
        ok = [r["first_token_s"] for r in rs if "error" not in r]
        ready = [r["ready_line_s"] for r in rs if r.get("ready_line_s") is not None]
        summary[kind] = {
            "median_s": median(ok) if ok else None,
            "min_s": min(ok, default=None),
            "max_s": max(ok, default=None),
            "ready_line_median_s": median(ready) if ready else None,
            "launches": len(rs),
            "failures": len(rs) - len(ok),
        }
    ref = summary.get("vllm", {}).get("median_s")
    print(f"\nmodel {model.name} ({args.dtype}), {args.threads} threads, {args.repeats} launches each")
    print(f"start: {load_line(info0)}\nend:   {load_line(info1)}\n")
    print(
        table(
            ["server", "first token s (median)", "min", "max", "÷ vLLM", "'serving' line s", "failures"],
            [
                [
                    k,
                    s["median_s"],
                    s["min_s"],
                    s["max_s"],
                    s["median_s"] / ref if ref and s["median_s"] else None,
                    s["ready_line_median_s"],
                    s["failures"],
                ]
                for k, s in summary.items()
            ],
        )
    )
    for kind, rs in runs.items():
        split = split_tables(rs)
        if split:
            print(f"\n{kind} start-up split ({sum('error' not in r for r in rs)} launches):\n{split}")
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
            "runs": runs,
            "summary": summary,
        },
    )
    png = bar_plot(
        args.out.with_suffix(".png"),
        f"launch -> first streamed token (load {info0['loadavg'][0]:.1f})",
        list(summary),
        {"median s": [s["median_s"] for s in summary.values()]},
        "seconds",
    )
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
