#!/usr/bin/env python
"""Prompt attention against torch's SDPA: in bfloat16 csrc/bf16_attention.c (AVX512-BF16, for CPUs without
AMX) or csrc/amx_attention.c (AMX tiles), in float32 csrc/f32_attention.c (AVX-512 FMAs).

    python bench/prompt_attention.py                 # kernel GF/s, then the end-to-end prefill A/B
    python bench/prompt_attention.py --no-e2e        # kernel rows only
    python bench/prompt_attention.py --kernel amx    # the AMX kernel's rows (no end-to-end A/B: the
                                                     # engine has no switch for AMX attention alone)
    python bench/prompt_attention.py --kernel f32    # the float32 kernel, then its end-to-end A/B
    python bench/prompt_attention.py --heads 24 --head-dim 32 --e2e-model default
                                                     # the bundled default model's head_dim

Kernel rows: one causal prompt of L tokens, 12 heads x head_dim 64 (the bench's medium model; --heads and
--head-dim for others), --threads
threads; GF/s count the causal half only (2 products x 2 flops x H x D x L (L + 1) / 2), the same for
both; each figure is the fastest of --repeat calls, the two paths timed alternately (the machine is
shared: read the ratio). "step" rows: several prompts in one kernel call against one SDPA call each,
as the backend makes them.

End-to-end: asyncengine LLM.generate of bench/sweep.py's cell "p512-2048/prefill" (64 prompts of
512-2048 tokens, max_tokens=1, cold prefix cache), model medium4k in the kernel's dtype, --threads
threads. Two engines stay loaded, one with the kernel and one with its switch off
(ASYNCENGINE_CPU_BF16_ATTENTION=0 or ASYNCENGINE_CPU_F32_ATTENTION=0: the SDPA path; the variable is read
in the worker processes, set when each engine spawns them), and the runs alternate. --e2e-model default:
the bundled default model (head_dim 32) and the cell "p16-1024/prefill" instead (bench/sweep.py --model
default: the cells that fit its 1,024 positions).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

import asyncengine  # noqa: F401  (the installed package first)
from asyncengine.cpu import bf16_attention, f32_attention
from asyncengine.cpu.attention import amx_prompt_attention, load_amx_library
from asyncengine.layers.attention_torch import causal_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, table  # noqa: E402


def best(fn, repeat: int) -> float:
    """The fastest of `repeat` calls, seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


class Kernel(NamedTuple):
    fn: Callable[..., bool]
    load: Callable[[], object]
    dtype: torch.dtype
    switch: str | None  # the engine's environment switch for it alone (the end-to-end A/B), if any
    needs: str  # what the CPU must have


KERNELS = {
    "bf16": Kernel(
        bf16_attention.bf16_prompt_attention,
        bf16_attention.load_library,
        torch.bfloat16,
        bf16_attention.ENV,
        "AVX512-BF16",
    ),
    "amx": Kernel(amx_prompt_attention, load_amx_library, torch.bfloat16, None, "AMX-BF16"),
    "f32": Kernel(
        f32_attention.f32_prompt_attention,
        f32_attention.load_library,
        torch.float32,
        f32_attention.ENV,
        "AVX-512",
    ),
}


def time_case(lens: list[int], heads: int, dim: int, repeat: int, which: str = "bf16") -> tuple[float, float]:
    """(SDPA, kernel) seconds for causal prompts of `lens` tokens: one kernel call, one SDPA call each."""
    torch.manual_seed(0)
    scale, t = dim**-0.5, sum(lens)
    q, k, v = (torch.randn(t, heads, dim).to(KERNELS[which].dtype) for _ in range(3))
    out = torch.empty_like(q)
    seqs, start = [], 0
    for n in lens:
        seqs.append((start, n, start, n))
        start += n

    def kernel() -> None:
        assert KERNELS[which].fn(q, k, v, out, seqs, scale, None)

    def sdpa() -> None:
        for s, n, _, _ in seqs:
            out[s : s + n] = causal_attention(q[s : s + n], k[s : s + n], v[s : s + n], scale)

    kernel(), sdpa()  # warm: the library's build, the kernel's buffer, torch's first call
    tk, ts = float("inf"), float("inf")
    for _ in range(3):  # alternated, so that the machine's other load hits both alike
        tk, ts = min(tk, best(kernel, repeat)), min(ts, best(sdpa, repeat))
    return ts, tk


def kernel_rows(
    threads: int, repeat: int, which: str = "bf16", heads: int = 12, dim: int = 64
) -> list[list[object]]:
    torch.set_num_threads(threads)
    cases = [[n] for n in (256, 512, 1024, 2048)] + [[512, 1024, 1536, 2048], [256] * 8]
    rows = []
    for lens in cases:
        ts, tk = time_case(lens, heads, dim, repeat, which)
        flops = sum(2 * 2 * heads * dim * n * (n + 1) / 2 for n in lens)
        name = f"L={lens[0]}" if len(lens) == 1 else "step " + "+".join(map(str, lens))
        rows.append([name, ts * 1e3, tk * 1e3, flops / ts / 1e9, flops / tk / 1e9, ts / tk])
    return rows


# the end-to-end run's model -> its bench/sweep.py cell: the bundled model's 1,024 positions hold the
# 16-1024-token prompts, not the 512-2048 ones
E2E_CELLS = {"medium4k": "p512-2048/prefill", "default": "p16-1024/prefill"}


def e2e_rows(
    threads: int, rounds: int, kv_gib: float, kernel: Kernel, model_name: str = "medium4k"
) -> list[list[object]]:
    from sweep import asyncengine_session, bundled_model, cells, warm_up

    model = bundled_model() if model_name == "default" else build_model(model_name)
    wl = dict(cells(64, 0, False))[E2E_CELLS[model_name]]
    dtype = str(kernel.dtype).removeprefix("torch.")
    # the sweep's asyncengine session with its defaults: greedy (no --temperature)
    args = argparse.Namespace(threads=threads, max_num_batched_tokens=2048, kv_gib=kv_gib, temperature=0.0)
    times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    firsts: dict[str, list[int]] = {}
    with contextlib.ExitStack() as stack:
        engines = {}
        for mode, value in (("kernel", "1"), ("sdpa", "0")):
            os.environ[kernel.switch] = value  # inherited by the worker processes this engine spawns
            engines[mode] = stack.enter_context(asyncengine_session(model, dtype, args))
        os.environ.pop(kernel.switch)
        for run in engines.values():
            run("warm-up", warm_up())  # untimed
        for _ in range(rounds):
            for mode, run in engines.items():
                r = run(mode, wl)  # cold prefix cache, timed
                times[mode].append(r["seconds"])
                firsts[mode] = [ids[0] for ids in r["token_ids"]]
    tokens = sum(len(p) for p in wl.prompts)
    agree = sum(a == b for a, b in zip(firsts["kernel"], firsts["sdpa"]))
    print(f"first tokens equal, kernel vs SDPA: {agree}/{len(wl.prompts)}")
    print("seconds per round:", {m: [round(t, 2) for t in ts] for m, ts in times.items()})
    rows = []
    for mode, ts in times.items():
        med = statistics.median(ts)
        rows.append([mode, min(ts), med, tokens / med, statistics.median(times["sdpa"]) / med])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="end-to-end runs per path, alternated")
    p.add_argument("--kv-gib", type=float, default=2.0, help="KV cache of each of the two engines")
    p.add_argument("--no-e2e", action="store_true")
    p.add_argument("--kernel", choices=sorted(KERNELS), default="bf16")
    p.add_argument("--heads", type=int, default=12, help="kernel rows: query heads (as many KV heads)")
    p.add_argument("--head-dim", type=int, default=64, help="kernel rows: head_dim")
    p.add_argument(
        "--e2e-model",
        choices=sorted(E2E_CELLS),
        default="medium4k",
        help="end-to-end: the sweep's model, or the bundled default model (head_dim 32)",
    )
    args = p.parse_args(argv)
    kernel = KERNELS[args.kernel]
    if kernel.load() is None:
        print(f"no {kernel.needs} on this CPU (or no C compiler)")
        return 1
    dtype = str(kernel.dtype).removeprefix("torch.")
    print(
        f"{dtype} causal prompt attention ({args.kernel} kernel), {args.heads} heads x {args.head_dim}, "
        f"{args.threads} threads"
    )
    headers = ["prompts", "SDPA ms", "kernel ms", "SDPA GF/s", "kernel GF/s", "speed-up"]
    rows = kernel_rows(args.threads, args.repeat, args.kernel, args.heads, args.head_dim)
    print(table(headers, rows))
    if not args.no_e2e and kernel.switch is not None:
        print(
            f"\nprefill-only, {E2E_CELLS[args.e2e_model]} (64 prompts, max_tokens=1), {args.e2e_model} "
            f"{dtype}, {args.threads} threads"
        )
        headers = ["attention", "best s", "median s", "prompt tok/s", "speed-up"]
        print(table(headers, e2e_rows(args.threads, args.rounds, args.kv_gib, kernel, args.e2e_model)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
