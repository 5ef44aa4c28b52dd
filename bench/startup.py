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
Also reported for asyncengine: when it printed its "serving on" line. Every server is killed (its
whole process group) before the next launch. Writes bench/out/startup.json and bench/out/startup.png.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import threading
import time
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

    body = {"model": "bench", "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
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


def launch_once(kind: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    cmd, env = server_command(kind, model, port, args)
    ready_at: list[float] = []
    t0 = time.perf_counter()
    with started(cmd, env=env, cwd=OUT) as proc:  # output on a pipe, drained by the thread below

        def drain() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                if not ready_at and b"asyncengine serving" in raw:
                    ready_at.append(time.perf_counter())

        threading.Thread(target=drain, daemon=True).start()
        t_tok = first_token(f"http://127.0.0.1:{port}", proc, t0 + args.timeout)
    return {"first_token_s": t_tok - t0, "ready_line_s": (ready_at[0] - t0) if ready_at else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default | tiny | medium | a model directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--servers", nargs="+", default=["asyncengine", "vllm"], choices=["asyncengine", "vllm"])
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take to the first token")
    p.add_argument("--quick", action="store_true", help="one launch per server")
    p.add_argument("--out", type=Path, default=OUT / "startup.json")
    args = p.parse_args(argv)
    if args.quick:
        apply_quick(args, p, {"repeats": 1})
    model = resolve_model(args.model)
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
            print(f"\n{kind} launch failed: {type(e).__name__}: {e}", file=sys.stderr)
            runs[kind].append({"error": f"{type(e).__name__}: {e}"[:300]})
    info1 = machine_info()

    summary = {}
    for kind, rs in runs.items():
        ok = [r["first_token_s"] for r in rs if "error" not in r]
        ready = [r["ready_line_s"] for r in rs if r.get("ready_line_s") is not None]
        summary[kind] = {"median_s": median(ok) if ok else None, "min_s": min(ok, default=None),
                         "max_s": max(ok, default=None), "ready_line_median_s": median(ready) if ready else None,
                         "launches": len(rs), "failures": len(rs) - len(ok)}
    ref = summary.get("vllm", {}).get("median_s")
    print(f"\nmodel {model.name} ({args.dtype}), {args.threads} threads, {args.repeats} launches each")
    print(f"start: {load_line(info0)}\nend:   {load_line(info1)}\n")
    print(table(["server", "first token s (median)", "min", "max", "÷ vLLM", "'serving' line s", "failures"],
                [[k, s["median_s"], s["min_s"], s["max_s"], s["median_s"] / ref if ref and s["median_s"] else None,
                  s["ready_line_median_s"], s["failures"]] for k, s in summary.items()]))
    for n in notes:
        print(f"note: {n}")
    write_json(args.out, {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                          "model": str(model), "machine_start": info0, "machine_end": info1, "notes": notes,
                          "runs": runs, "summary": summary})
    png = bar_plot(args.out.with_suffix(".png"), f"launch -> first streamed token (load {info0['loadavg'][0]:.1f})",
                   list(summary), {"median s": [s["median_s"] for s in summary.values()]}, "seconds")
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
