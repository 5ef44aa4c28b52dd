#!/usr/bin/env python
"""Decode attention out of cache: csrc/paged_attention.c against the bytes it must read, one run.

    python bench/paged_attention.py                  # bfloat16, 2 threads, the shapes below
    python bench/paged_attention.py --shapes 64x256 16x1024 --shared

One decode row per sequence (batch B, L keys each), 12 heads x head_dim 64 (the bench's medium model),
block size 16, block tables scattered at random over the cache (as after a while of serving), the caches
on the engine's pages (4 KiB; 2 MiB with ASYNCENGINE_CPU_KV_HUGEPAGES=1, cpu/prefault.py); every shape
keeps 12 layers' K/V, cycled, so that each call reads from DRAM as a decode step does (batch 64 x 256
keys: 600 MiB; a small batch's 12 layers fit in L3, as in its own decode step). Per shape: ms per layer,
the K/V read rate, and that rate over the streaming-read rate measured in the same run (torch.sum over 1
GiB). --shared also runs each shape with half of every table pointing at one prefix (read once per group
of rows). The fastest of --repeat passes over the 12 layers. Writes bench/out/paged_attention.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, STREAM_BYTES, load_line, machine_info, stream_read_seconds, table, write_json  # noqa: E402

import asyncengine  # noqa: E402, F401  (the installed package first)
from asyncengine.cpu.attention import load_kernel_library, paged_attention  # noqa: E402
from asyncengine.cpu.prefault import huge_pages_enabled  # noqa: E402
from asyncengine.worker.model_runner import zeros  # noqa: E402

HEADS, HEAD_DIM, BLOCK, LAYERS = 12, 64, 16, 12
CPU = torch.device("cpu")


def measure(batch: int, keys: int, shared: bool, repeat: int, dtype: torch.dtype) -> dict[str, Any]:
    lib = load_kernel_library()
    assert lib is not None, "the attention kernel did not build (no C compiler?)"
    kernel = {torch.bfloat16: "paged_attention_bf16", torch.float32: "paged_attention_f32"}[dtype]
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-keys // BLOCK)
    num_blocks = batch * per_seq + 1
    shape = (num_blocks, BLOCK, HEADS, HEAD_DIM)
    huge = huge_pages_enabled()  # the pages the engine's cache is on (cpu/prefault.py)
    caches = [
        tuple(zeros(shape, dtype, CPU, huge).copy_(torch.randn(shape, generator=gen)) for _ in range(2))
        for _ in range(LAYERS)
    ]
    tables = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq)
    if shared:
        tables[:, : per_seq // 2] = tables[0, : per_seq // 2]
    tables = tables.to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), keys, dtype=torch.int32)
    query_start = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(q)

    def layer(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        paged_attention(
            lib, kernel, q, k_cache, v_cache, out, tables, query_start, seq_lens, None, HEAD_DIM**-0.5, 0
        )

    layer(*caches[0])
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for k_cache, v_cache in caches:
            layer(k_cache, v_cache)
        best = min(best, time.perf_counter() - t0)
    distinct = len(torch.unique(tables)) if shared else batch * per_seq
    read = distinct * BLOCK * HEADS * HEAD_DIM * 2 * dtype.itemsize * LAYERS  # K and V bytes read
    return {"ms_per_layer": best / LAYERS * 1e3, "gb_s": read / best / 1e9}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shapes", nargs="+", default=["1x256", "4x1024", "16x1024", "64x128", "64x256", "32x600"]
    )
    p.add_argument("--shared", action="store_true", help="also each shape with a shared half-prefix")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", type=Path, default=OUT / "paged_attention.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    info = machine_info()
    stream = STREAM_BYTES / stream_read_seconds() / 1e9
    rows, results = [], []
    for shape in args.shapes:
        batch, keys = (int(v) for v in shape.split("x"))
        for shared in (False, True) if args.shared else (False,):
            r = measure(batch, keys, shared, args.repeat, dtype)
            r |= {"batch": batch, "keys": keys, "shared": shared}
            results.append(r)
            label = f"{batch} x {keys}" + (" shared half" if shared else "")
            rows.append([label, r["ms_per_layer"], r["gb_s"], r["gb_s"] / stream])
            print(rows[-1], flush=True)
    print(
        f"\n{args.dtype}, {HEADS} heads x {HEAD_DIM}, block {BLOCK}, {args.threads} threads; "
        f"streaming read {stream:.1f} GB/s; {load_line(info)}"
    )
    print(table(["batch x keys", "ms / layer", "K/V GB/s", "of streaming"], rows))
    write_json(args.out, {"machine": info, "stream_gb_s": stream, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
