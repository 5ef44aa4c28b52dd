#!/usr/bin/env python
"""Decode attention out of cache: csrc/paged_attention.c against the bytes it must read, one run.

    python bench/paged_attention.py                  # bfloat16, 2 threads, the shapes below
    python bench/paged_attention.py --shapes 64x256 16x1024 --shared
    python bench/paged_attention.py --heads 16 --kv-heads 4 --amx-ab   # grouped-query, AMX scores on / off

One decode row per sequence (batch B, L keys each), 12 heads x head_dim 64 (the bench's medium model; other
layouts with --heads / --kv-heads / --head-dim), blocks of 64 tokens (the CPU default; --block-size), block
tables scattered at random over the cache (as after a while of serving), the caches on the engine's pages (4
KiB; 2 MiB with ASYNCENGINE_CPU_KV_HUGEPAGES=1, cpu/prefault.py); every shape keeps 12 layers' K/V, cycled,
so that each call reads from DRAM as a decode step does (batch 64 x 256 keys: 600 MiB; a small batch's 12
layers fit in L3, as in its own decode step). Per shape: ms per layer, the K/V read rate, and that rate over
the streaming-read rate measured in the same run (torch.sum over 1 GiB). --shared also runs each shape with
half of every table pointing at one prefix (read once per group of rows). --amx-ab runs every shape with the
grouped-query AMX scores (csrc/paged_attention.c's amx_scores) on and off, alternately. The fastest of
--repeat passes over the 12 layers. Writes bench/out/paged_attention.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, STREAM_BYTES, load_line, machine_info, stream_read_seconds, table, write_json  # noqa: E402

import asyncengine  # noqa: E402, F401  (the installed package first)
from asyncengine.config import CPU_BLOCK_SIZE  # noqa: E402
from asyncengine.cpu import amx as cpu_amx  # noqa: E402
from asyncengine.cpu.attention import load_kernel_library, paged_attention  # noqa: E402
from asyncengine.cpu.prefault import huge_pages_enabled  # noqa: E402
from asyncengine.worker.model_runner import zeros  # noqa: E402

LAYERS = 12
CPU = torch.device("cpu")


class Heads(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int


def measure(
    batch: int,
    keys: int,
    shared: bool,
    repeat: int,
    dtype: torch.dtype,
    layout: Heads,
    amx: bool | None,
    block: int = CPU_BLOCK_SIZE,
) -> dict[str, Any]:
    """`amx`: the grouped-query AMX scores on or off for this run (None: as loaded)."""
    heads, kv_heads, head_dim = layout
    lib = load_kernel_library()
    assert lib is not None, "the attention kernel did not build (no C compiler?)"
    if amx is not None:
        lib.paged_attention_use_amx(int(amx))
    kernel = {torch.bfloat16: "paged_attention_bf16", torch.float32: "paged_attention_f32"}[dtype]
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-keys // block)
    num_blocks = batch * per_seq + 1
    shape = (num_blocks, block, kv_heads, head_dim)
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
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)

    def layer(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        paged_attention(
            lib, kernel, q, k_cache, v_cache, out, tables, query_start, seq_lens, None, head_dim**-0.5, 0
        )

    layer(*caches[0])
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for k_cache, v_cache in caches:
            layer(k_cache, v_cache)
        best = min(best, time.perf_counter() - t0)
    distinct = len(torch.unique(tables)) if shared else batch * per_seq
    read = distinct * block * kv_heads * head_dim * 2 * dtype.itemsize * LAYERS  # K and V bytes read
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
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (one KV head each)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=CPU_BLOCK_SIZE, help="tokens per KV-cache block")
    p.add_argument(
        "--amx-ab", action="store_true", help="each shape with the AMX scores on and off, alternately"
    )
    p.add_argument("--out", type=Path, default=OUT / "paged_attention.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    info = machine_info()
    stream = STREAM_BYTES / stream_read_seconds() / 1e9
    layout = Heads(args.heads, args.kv_heads or args.heads, args.head_dim)
    lib = load_kernel_library()
    modes: list[bool | None] = [True, False] if args.amx_ab else [None]
    rows, results = [], []
    try:
        for i, shape in enumerate(args.shapes):
            batch, keys = (int(v) for v in shape.split("x"))
            for shared in (False, True) if args.shared else (False,):
                for amx in modes if i % 2 == 0 else modes[::-1]:  # alternated: the machine is shared
                    r = measure(batch, keys, shared, args.repeat, dtype, layout, amx, args.block_size)
                    r |= {"batch": batch, "keys": keys, "shared": shared, "amx": amx}
                    results.append(r)
                    label = f"{batch} x {keys}" + (" shared half" if shared else "")
                    label += {True: ", AMX scores", False: ", vector scores", None: ""}[amx]
                    rows.append([label, r["ms_per_layer"], r["gb_s"], r["gb_s"] / stream])
                    print(rows[-1], flush=True)
    finally:
        if lib is not None:  # back to the setting load_kernel_library made
            lib.paged_attention_use_amx(int(cpu_amx.allowed()))
    print(
        f"\n{args.dtype}, {layout.heads} heads over {layout.kv_heads} KV heads x {layout.head_dim}, block "
        f"{args.block_size}, {args.threads} threads; streaming read {stream:.1f} GB/s; {load_line(info)}"
    )
    print(table(["batch x keys", "ms / layer", "K/V GB/s", "of streaming"], rows))
    write_json(args.out, {"machine": info, "stream_gb_s": stream, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
