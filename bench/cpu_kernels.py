#!/usr/bin/env python
"""CPU kernels side by side: each fast path against the PyTorch code it replaces, in one run.

    python bench/cpu_kernels.py                  # 2 threads, float32 and bfloat16
    python bench/cpu_kernels.py --threads 1

Rows (shapes of a decode step of the "medium" bench model: hidden 768, 12 heads of 64, intermediate
2048, vocab 32000, batch 64, contexts 50-500 tokens, block size 16):
* paged attention, one layer: the C kernel (AVX-512 build where the CPU has it, and the portable
  build) vs the PyTorch reference (gather + SDPA). Also GB/s of K/V read. Each timed call reads a
  different layer's cache (12 of them), so the K/V come from memory as in a real step, not from L3.
* linear layers: packed weights (cpu/gemm.py: AMX tiles for bfloat16 where the CPU has AMX, else
  oneDNN) vs F.linear, per projection, at M = 64.
* bfloat16 GEMM pass: all 12 layers' projections and the LM head (219 MB of distinct weights, so they
  come from memory as in a step) at M = 1 ... 64, the layers alone at M = 128 ... 4096 (prefill sizes),
  the AMX kernel (cpu/amx.py) vs oneDNN-packed weights; "speed" is oneDNN's time over the AMX kernel's.
  Needs an AMX CPU.  `--groups "gemm pass"` runs these rows alone.
* element-wise: the fused C ops (cpu/ops.py) vs the torch code they replace; the KV-cache write
  (cpu_ops.write_kv vs index_copy_) and the sampler's greedy pick (cpu_ops.argmax_rows on the logits \
as they are vs argmax).
* sampler: the Sampler's C kernel (cpu/sampling.py: one uniform draw a row, radix-selected top-k /
  top-p cuts) vs its torch path (exponential race, sorts), per sampling setting, bfloat16 logits of
  [64, 32000] (random and trained-model-like), [8, 32000] and [64, 152064]; and the penalties over
  100-1000-token histories, the worker's per-sequence PenaltyState vs the token lists row by row.
  `--groups sampler` runs these alone.
* memory: torch.sum over 1 GiB, the streaming-read rate the attention rows' GB/s compare to.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import OUT, STREAM_BYTES, load_line, machine_info, stream_read_seconds, table, write_json
from tqdm import tqdm

import asyncengine  # noqa: F401  (the installed package first)
from asyncengine.cpu import amx as cpu_amx
from asyncengine.cpu import gemm as cpu_gemm
from asyncengine.cpu import ops as cpu_ops
from asyncengine.cpu.attention import load_kernel_library
from asyncengine.cpu.malloc import keep_freed_memory
from asyncengine.layers.activation import ActAndMul
from asyncengine.layers.attention import AttentionMetadata
from asyncengine.layers.attention_cpu import CpuAttentionBackend
from asyncengine.layers.attention_torch import TorchAttentionBackend
from asyncengine.layers.norm import RMSNorm
from asyncengine.layers.rotary import apply_rotary
from asyncengine.layers.sampler import argmax_rows


def timeit(fn: Callable[[int], Any], repeat: int) -> float:
    """Median seconds of fn(i) over `repeat` calls (i = call index), after two warm-up calls."""
    fn(0), fn(1)
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def torch_path(fn: Callable[[], Any]) -> Any:
    with cpu_ops.disabled():
        return fn()


def attention_rows(dtype: torch.dtype, layers: int, repeat: int) -> list[list[Any]]:
    rng = random.Random(0)
    batch, heads, head_dim, bs = 64, 12, 64, 16
    lens = [rng.randint(50, 500) for _ in range(batch)]
    nblk = sum(-(-n // bs) for n in lens)
    perm = torch.randperm(nblk).tolist()  # scattered blocks, as after a while of serving
    tables = torch.zeros(batch, max(-(-n // bs) for n in lens), dtype=torch.int32)
    i = 0
    for s, n in enumerate(lens):
        k = -(-n // bs)
        tables[s, :k] = torch.tensor(perm[i : i + k])
        i += k
    caches = [
        (
            torch.randn(nblk, bs, heads, head_dim, dtype=dtype),
            torch.randn(nblk, bs, heads, head_dim, dtype=dtype),
        )
        for _ in range(layers)
    ]
    q = torch.randn(batch, heads, head_dim, dtype=dtype)
    k = torch.zeros(batch, heads, head_dim, dtype=dtype)
    meta = AttentionMetadata(
        torch.zeros(batch, dtype=torch.long),
        torch.arange(batch + 1, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        tables,
        [1] * batch,
        lens,
        1,
        max(lens),
    )
    nbytes = sum(lens) * heads * head_dim * 2 * q.element_size()
    backends = {
        "C kernel (native)": CpuAttentionBackend(load_kernel_library()),
        "C kernel (portable)": CpuAttentionBackend(load_kernel_library(portable=True)),
        "torch reference": TorchAttentionBackend(),
    }
    times = {
        name: timeit(lambda i, b=b: b.forward(q, k, k, *caches[i % layers], meta, 0.125), repeat)
        for name, b in backends.items()
    }
    ref = times["torch reference"]
    return [
        [f"attention {str(dtype)[6:]}", name, t * 1e3, nbytes / t / 1e9, ref / t] for name, t in times.items()
    ]


def linear_rows(dtype: torch.dtype, repeat: int) -> list[list[Any]]:
    rows = []
    for name, k, n in (
        ("qkv 768->2304", 768, 2304),
        ("gate_up 768->4096", 768, 4096),
        ("down 2048->768", 2048, 768),
        ("lm_head 768->32000", 768, 32000),
    ):
        w = torch.randn(n, k, dtype=dtype) * 0.02
        packed = cpu_gemm.prepack(w)
        x = torch.randn(64, k, dtype=dtype)
        plain = timeit(lambda i, x=x, w=w: F.linear(x, w), repeat)
        fast = (
            timeit(lambda i, x=x, packed=packed: cpu_gemm.linear(x, packed, None), repeat)
            if packed is not None
            else float("nan")
        )
        rows.append(
            [
                f"linear {str(dtype)[6:]}",
                f"{name}, M=64",
                fast * 1e3,
                2 * 64 * k * n / fast / 1e9,
                plain / fast,
            ]
        )
    return rows


def gemm_pass_rows(repeat: int) -> list[list[Any]]:
    if not cpu_amx.available():
        return []
    keep_freed_memory()  # as a CPU worker's malloc (cpu/malloc.py): outputs reuse freed memory
    shapes = [(768, 2304), (768, 768), (768, 4096), (2048, 768)] * 12 + [(768, 32000)]  # (in, out)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for k, n in shapes]
    amx = [cpu_amx.pack(w) for w in weights]
    # oneDNN's own packed layout, called directly: cpu_gemm.prepack would hand an AMX-less bfloat16 weight
    # to the AVX512-BF16 kernel (cpu/quant_gemm.py), which is not what this column compares against
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, cpu_gemm.BATCH_HINT) for w in weights]
    del weights
    mb = sum(p.numel() for p in amx) * 2 / 1e6
    rows = []
    for m in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (768, 2048)}
        reps = max(3, repeat // 6) if m <= 256 else 3

        # from M = 128 on (prefill chunks) the 48 layer GEMMs only: a prefill runs the LM head on its sampled
        # rows, and a [4096, 32000] output would measure page faults
        last = len(shapes) if m <= 64 else len(shapes) - 1

        def run(packs: list[Any], xs: dict[int, torch.Tensor] = xs, last: int = last) -> None:
            for (k, _), p in zip(shapes[:last], packs[:last], strict=True):
                cpu_gemm.linear(xs[k], p, None)

        # interleaved, the best of three rounds each: the weights' reads are what is measured
        t_amx = t_dnn = float("inf")
        for _ in range(3):
            t_amx = min(t_amx, timeit(lambda i: run(amx), reps))
            t_dnn = min(t_dnn, timeit(lambda i: run(onednn), reps))
        # weights GB/s where reading them bounds the pass (decode sizes), GFLOP/s where the tiles do
        flops = 2 * m * sum(k * n for k, n in shapes[:last])
        rate, what = (mb / t_amx / 1e3, f"{mb:.0f} MB; GB/s") if m <= 64 else (flops / t_amx / 1e9, "GFLOP/s")
        rows.append(
            [
                "GEMM pass bfloat16" if m <= 64 else "GEMM pass bfloat16, layers",
                f"AMX vs oneDNN, M={m} ({what})",
                t_amx * 1e3,
                rate,
                t_dnn / t_amx,
            ]
        )
    return rows


def elementwise_rows(dtype: torch.dtype, repeat: int) -> list[list[Any]]:
    norm, act = RMSNorm(768).to(dtype), ActAndMul("silu")
    x, r = torch.randn(64, 768, dtype=dtype), torch.randn(64, 768, dtype=dtype)
    gu = torch.randn(64, 4096, dtype=dtype)
    cos, sin = torch.randn(64, 32, dtype=dtype), torch.randn(64, 32, dtype=dtype)
    ops = {
        "rms_norm + residual [64, 768]": lambda: norm.fused_add(x, r),
        "silu_and_mul [64, 2x2048]": lambda: act(gu),
        "rotary [64, 12x64]": lambda: apply_rotary(x, cos, sin, 64),
    }
    rows = []
    for name, fn in ops.items():
        fast = timeit(lambda i, fn=fn: fn(), repeat)
        plain = timeit(lambda i, fn=fn: torch_path(fn), repeat)
        rows.append([f"element-wise {str(dtype)[6:]}", name, fast * 1e3, None, plain / fast])
    # the step's KV-cache write (k, v: column slices of the fused qkv output) and the greedy pick
    qkv = torch.randn(64, 3 * 768, dtype=dtype)
    k, v = qkv[:, 768:1536].view(64, 12, 64), qkv[:, 1536:].view(64, 12, 64)
    kc, vc = torch.zeros(4096, 16, 12, 64, dtype=dtype), torch.zeros(4096, 16, 12, 64, dtype=dtype)
    slots = torch.randperm(4096 * 16)[:64]
    fast = timeit(lambda i: cpu_ops.write_kv(k, v, kc, vc, slots), repeat)
    plain = timeit(
        lambda i: (
            kc.view(-1, 12, 64).index_copy_(0, slots, k),
            vc.view(-1, 12, 64).index_copy_(0, slots, v),
        ),
        repeat,
    )
    rows.append(
        [
            f"element-wise {str(dtype)[6:]}",
            "KV write [64, 12x64] vs index_copy_",
            fast * 1e3,
            None,
            plain / fast,
        ]
    )
    logits = torch.randn(64, 32000)
    fast = timeit(lambda i: argmax_rows(logits), repeat)
    plain = timeit(lambda i: logits.argmax(dim=-1), repeat)
    rows.append(
        [
            f"element-wise {str(dtype)[6:]}",
            "greedy pick [64, 32000] vs argmax",
            fast * 1e3,
            None,
            plain / fast,
        ]
    )
    return rows


SAMPLINGS = {
    "temperature 1": dict(temperature=1.0),
    "t 0.8, top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "t 0.8, top-k 50": dict(temperature=0.8, top_k=50),
    "t 0.7, top-k 50, top-p 0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    "t 1, min-p 0.05": dict(temperature=1.0, min_p=0.05),
}


PENALTIES = {
    "repetition 1.1, greedy": dict(repetition_penalty=1.1),
    "frequency + presence 0.5, greedy": dict(frequency_penalty=0.5, presence_penalty=0.5),
}


def sampler_rows(dtype: torch.dtype, repeat: int) -> list[list[Any]]:
    """The Sampler on a decode step's logits: the C kernel (cpu/sampling.py) vs the torch path, per
    sampling setting, at batch 64 and 8 over a 32000-token vocabulary (the bench models') and batch 64
    over 152064 tokens (Qwen2's); "flat" logits are a random model's (N(0, 2)), "peaked" a trained
    model's (a few tokens far above the rest: top-k / top-p cut among those alone)."""
    from asyncengine.cpu import sampling as cpu_sampling
    from asyncengine.layers.sampler import PenaltyState, Sampler, SamplingRow
    from asyncengine.transport.wire import SamplingOptions

    sampler = Sampler(seed=0, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch, vocab, shape in (
        (64, 32000, "flat"),
        (64, 32000, "peaked"),
        (8, 32000, "flat"),
        (64, 152064, "peaked"),
    ):
        logits = torch.randn(batch, vocab, generator=g) * 2
        if shape == "peaked":  # a trained model's: 1-40 tokens 14-20 above the rest
            for row in logits:
                top = torch.randint(0, vocab, (int(torch.randint(1, 41, (1,), generator=g)),), generator=g)
                row[top] += 14 + 6 * torch.rand(len(top), generator=g)
        logits = logits.to(dtype)
        for name, kw in SAMPLINGS.items():
            srows = [SamplingRow(SamplingOptions(**kw), None, [], {}, 0) for _ in range(batch)]
            fast = timeit(lambda i, x=logits, r=srows: sampler(x, r), max(3, repeat // 3))
            saved, cpu_sampling._enabled = cpu_sampling._enabled, False
            try:
                plain = timeit(lambda i, x=logits, r=srows: sampler(x, r), max(3, repeat // 10))
            finally:
                cpu_sampling._enabled = saved
            variant = f"[{batch}, {vocab}] {shape}, {name}"
            rows.append([f"sampler {str(dtype)[6:]}", variant, fast * 1e3, None, plain / fast])
    # penalties over 100-1000-token histories (greedy): the worker's PenaltyState vs the lists per row
    logits = (torch.randn(64, 32000, generator=g) * 2).to(dtype)
    rng = random.Random(0)
    hists = [[rng.randrange(32000) for _ in range(rng.randint(100, 1000))] for _ in range(64)]
    for name, kw in PENALTIES.items():
        opts = SamplingOptions(temperature=0.0, **kw)
        times = []
        for dense in (True, False):
            srows = []
            for h in hists:
                counts: dict[int, int] = {}
                for t in h[len(h) // 2 :]:
                    counts[t] = counts.get(t, 0) + 1
                state = PenaltyState(h, len(h) // 2, 32000) if dense else None
                srows.append(SamplingRow(opts, None, h, counts, len(h) // 2, state))
            times.append(timeit(lambda i, r=srows: sampler(logits, r), max(3, repeat // 3)))
        variant = f"[64, 32000] {name}"
        rows.append([f"sampler {str(dtype)[6:]}", variant, times[0] * 1e3, None, times[1] / times[0]])
    return rows


def memory_rows(repeat: int) -> list[list[Any]]:
    """What the attention kernel's GB/s compares to: torch.sum streaming 1 GiB (no cache reuse)."""
    t = stream_read_seconds(max(3, repeat // 6))
    return [["memory", "DRAM read: torch.sum over 1 GiB", t * 1e3, STREAM_BYTES / t / 1e9, None]]


GROUPS = ("attention", "linear", "element-wise", "sampler", "gemm pass", "memory")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument(
        "--layers", type=int, default=12, help="distinct KV caches the attention rows cycle through"
    )
    p.add_argument(
        "--groups",
        nargs="+",
        choices=GROUPS,
        default=list(GROUPS),
        help="which rows to measure (default: all)",
    )
    p.add_argument("--out", type=Path, default=OUT / "cpu_kernels.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if cpu_ops.load_ops_library() is None or load_kernel_library() is None:
        print("no C compiler: nothing to compare", file=sys.stderr)
        return 1
    info = machine_info()
    rows: list[list[Any]] = []
    jobs = [
        (d, kind) for d in (torch.float32, torch.bfloat16) for kind in ("attention", "linear", "element-wise")
    ]
    jobs += [(torch.bfloat16, "sampler"), (torch.bfloat16, "gemm pass"), (torch.float32, "memory")]
    jobs = [(d, kind) for d, kind in jobs if kind in args.groups]
    for dtype, kind in tqdm(jobs, desc="cpu kernels", unit="group"):
        with torch.inference_mode():
            if kind == "attention":
                rows += attention_rows(dtype, args.layers, args.repeat)
            elif kind == "linear":
                rows += linear_rows(dtype, args.repeat)
            elif kind == "gemm pass":
                rows += gemm_pass_rows(args.repeat)
            elif kind == "memory":
                rows += memory_rows(args.repeat)
            elif kind == "sampler":
                rows += sampler_rows(dtype, args.repeat)
            else:
                rows += elementwise_rows(dtype, args.repeat)
    print(f"\n{args.threads} threads; {load_line(info)}")
    print(table(["group", "variant", "ms", "GB/s or GFLOP/s", "speed vs torch (GEMM pass: vs oneDNN)"], rows))
    write_json(
        args.out,
        {
            "machine": info,
            "threads": args.threads,
            "rows": [dict(zip(["group", "variant", "ms", "rate", "speedup"], r)) for r in rows],
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
