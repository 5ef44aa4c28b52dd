#!/usr/bin/env python
"""Where a CPU decode step's time goes, against the bytes it must move: one run, both dtypes.

    python bench/decode_step.py                       # medium model, batch 64, context 256, 2 threads
    python bench/decode_step.py --batch 32 --context 512
    python bench/decode_step.py --dtypes bfloat16 --kv-cache-dtypes auto fp8_e5m2 \
  # float8 K/V: half the reads
    python bench/decode_step.py --block-sizes 16 64   # KV-cache block sizes side by side
    python bench/decode_step.py --model gqa4k         # another of bench/common.py's models

Drives a ModelRunner directly (no engine, no sockets) on the bench's "medium" Llama (~100M, hidden
768, 12 layers): a prefill of `batch` random prompts of `context` tokens, then timed greedy decode
steps. Per dtype it prints
* ms per step and tokens/s;
* the bytes a step has to read: every weight once (the LM head included; the embedding table only
  row by row, left out) plus each sequence's K/V in every layer;
* the floor those bytes set at the streaming-read rate measured in the same run (torch.sum over 1 GiB)
  and the step's share of it ("bandwidth efficiency");
* a split of the step from torch.profiler: oneDNN linear layers, other torch ops, and the rest
  (the C attention kernel, the fused C ops and, on an AMX CPU, the bfloat16 GEMMs of cpu/amx.py,
  which the profiler does not see, plus Python);
* a second split by wall time, each entry point of the step wrapped in a timer for a few more steps
  (packed GEMMs (oneDNN or AMX) and plain ones, the C attention kernel, the KV write, RMSNorm, rotary,
  rotary fused with the KV write, SiLU-and-mul, the greedy pick, the step's input preparation); "rest"
  is Python, the embedding and small torch ops.
Writes bench/out/decode_step.json.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    MODEL_SPECS,
    OUT,
    STREAM_BYTES,
    build_model,
    load_line,
    machine_info,
    stream_read_seconds,
    table,
    write_json,
)
from tqdm import tqdm

import asyncengine  # noqa: F401  (the installed package first)
from asyncengine.config import EngineConfig
from asyncengine.cpu import gemm as cpu_gemm
from asyncengine.cpu import ops as cpu_ops
from asyncengine.cpu.amx import AmxWeight
from asyncengine.cpu.kernel_graph import KernelGraphRunner
from asyncengine.cpu.quant_gemm import QuantWeight
from asyncengine.layers import attention_cpu
from asyncengine.layers.attention import set_attention_backend
from asyncengine.layers.attention_cpu import CpuAttentionBackend
from asyncengine.layers.parallel import ParallelContext
from asyncengine.transport.wire import SamplingOptions
from asyncengine.worker.input_batch import SeqState, StepBatch
from asyncengine.worker.model_runner import ModelRunner

# (owner, attribute, label): the step's entry points, each looked up where it is called (module or class
# attribute), so replacing the attribute times every call
ENTRY_POINTS: list[tuple[Any, str, str]] = [
    (cpu_gemm, "linear", "packed GEMM"),
    (F, "linear", "plain GEMM"),
    (CpuAttentionBackend, "_run_kernel", "attention kernel"),
    (cpu_ops, "write_kv", "KV write"),
    (cpu_ops, "rms_norm", "RMSNorm"),
    (cpu_ops, "rotary", "rotary"),
    (cpu_ops, "rope_write_kv", "rotary + KV write"),
    (cpu_ops, "silu_and_mul", "SiLU"),
    (cpu_ops, "layer_norm", "LayerNorm"),
    (cpu_ops, "gelu_new", "GELU"),
    (attention_cpu, "_prompt_kernel", "prompt attention"),
    (cpu_ops, "argmax_rows", "argmax"),
    (ModelRunner, "prepare_model_input", "prepare"),
]


@contextlib.contextmanager
def timed_entry_points() -> Iterator[dict[str, float]]:
    """Wraps every ENTRY_POINTS callable in a wall-clock timer; yields label -> seconds (summed)."""
    spent: dict[str, float] = {label: 0.0 for *_, label in ENTRY_POINTS}
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in ENTRY_POINTS]

    def timer(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0

        return call

    for (owner, name, fn), (*_, label) in zip(saved, ENTRY_POINTS):
        setattr(owner, name, timer(fn, label))
    try:
        yield spent
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def measure(
    model: Path, dtype: str, kv_dtype: str, block_size: int | None, batch: int, context: int, steps: int
) -> dict[str, Any]:
    torch_dtype = getattr(torch, dtype)
    set_attention_backend(CpuAttentionBackend())
    cfg = EngineConfig(model=str(model), dtype=dtype, max_num_seqs=max(batch, 1), kv_cache_dtype=kv_dtype)
    if block_size is not None:
        cfg = cfg.replace(block_size=block_size)
    max_len = context + steps + 16
    runner = ModelRunner(cfg, ParallelContext(), torch.device("cpu"), torch_dtype, max_len)
    per_seq = -(-max_len // cfg.block_size)
    runner.init_cache(batch * per_seq)
    blocks = list(range(batch * per_seq))
    random.Random(0).shuffle(blocks)  # scattered blocks, as after a while of serving
    rng = random.Random(1)
    vocab = runner.model.config.vocab_size
    seqs = [
        SeqState(
            i,
            [rng.randrange(vocab) for _ in range(context)],
            context,
            blocks[i * per_seq : (i + 1) * per_seq],
            0,
            SamplingOptions(temperature=0.0),
        )
        for i in range(batch)
    ]
    chunk = max(1, 2048 // context)
    for i in range(0, batch, chunk):
        group = seqs[i : i + chunk]
        out = runner.execute_model(
            runner.prepare_model_input(StepBatch(0, group, [context] * len(group), [0] * len(group))), None
        )
        for s, t in zip(group, out.token_ids):
            s.num_computed_tokens = context
            s.token_ids.append(t)

    def step(k: int) -> None:
        out = runner.execute_model(
            runner.prepare_model_input(StepBatch(k, seqs, [1] * batch, [0] * batch)), None
        )
        for s, t in zip(seqs, out.token_ids):
            s.num_computed_tokens += 1
            s.token_ids.append(t)

    for k in range(2):
        step(k)
    t0 = time.perf_counter()
    for k in range(steps):
        step(k)
    seconds = (time.perf_counter() - t0) / steps
    prof_steps = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t1 = time.perf_counter()
        for k in range(prof_steps):
            step(k)
        prof_seconds = (time.perf_counter() - t1) / prof_steps
    # the split runs eagerly: a kernel-graph replay calls the C kernels without their Python entry points
    graphs = runner.graph_runner if isinstance(runner.graph_runner, KernelGraphRunner) else None
    replaying = graphs is not None and graphs.enabled
    if graphs is not None:
        graphs.enabled = False
    with timed_entry_points() as spent:
        t2 = time.perf_counter()
        for k in range(prof_steps):
            step(k)
        timed_seconds = (time.perf_counter() - t2) / prof_steps
    if graphs is not None:
        graphs.enabled = replaying
    breakdown = {label: s / prof_steps * 1e3 for label, s in spent.items()}
    breakdown["rest"] = timed_seconds * 1e3 - sum(breakdown.values())
    linear = other = 0.0
    for ev in prof.key_averages():
        us = ev.self_cpu_time_total / prof_steps
        if "linear" in ev.key:
            linear += us
        else:
            other += us
    elem = torch.empty((), dtype=torch_dtype).element_size()
    weights = sum(p.numel() for n, p in runner.model.named_parameters() if "embed_tokens" not in n) * elem
    packed = sum(
        m.packed.nbytes() if isinstance(m.packed, QuantWeight) else m.packed.numel() * elem
        for m in runner.model.modules()
        if isinstance(getattr(m, "packed", None), (torch.Tensor, AmxWeight, QuantWeight))
    )
    ctx = context + 2 + steps / 2  # mean context over the timed steps
    kv = runner.kv_bytes_per_block / cfg.block_size * ctx * batch
    return {
        "dtype": dtype,
        "kv_cache_dtype": kv_dtype,
        "block_size": cfg.block_size,
        "ms": seconds * 1e3,
        "tok_s": batch / seconds,
        "weight_bytes": weights + packed,
        "kv_bytes": kv,
        "linear_ms": linear / 1e3,
        "other_ops_ms": other / 1e3,
        "rest_ms": prof_seconds * 1e3 - (linear + other) / 1e3,
        "prof_ms": prof_seconds * 1e3,
        "timed_ms": timed_seconds * 1e3,
        "breakdown_ms": breakdown,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="medium", choices=sorted(MODEL_SPECS), help="bench/common.py's model spec"
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=["auto", "fp8_e5m2"])
    p.add_argument(
        "--block-sizes",
        nargs="+",
        type=int,
        default=[None],
        help="KV-cache block sizes (default: the engine's)",
    )
    p.add_argument("--out", type=Path, default=OUT / "decode_step.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info()
    model = build_model(args.model)
    rate = STREAM_BYTES / stream_read_seconds()
    runs = [(d, kv, b) for d in args.dtypes for kv in args.kv_cache_dtypes for b in args.block_sizes]
    results = [
        measure(model, d, kv, b, args.batch, args.context, args.steps)
        for d, kv, b in tqdm(runs, desc="decode step")
    ]
    rows = []
    for r in results:
        floor_ms = (r["weight_bytes"] + r["kv_bytes"]) / rate * 1e3
        rows.append(
            [
                r["dtype"],
                r["kv_cache_dtype"],
                r["block_size"],
                r["ms"],
                r["tok_s"],
                r["weight_bytes"] / 2**20,
                r["kv_bytes"] / 2**20,
                floor_ms,
                100 * floor_ms / r["ms"],
                r["linear_ms"],
                r["other_ops_ms"],
                r["rest_ms"],
            ]
        )
    print(
        f"\n{args.model} model, batch {args.batch}, context ~{args.context}, {args.threads} threads; "
        f"streaming read {rate / 1e9:.1f} GB/s; {load_line(info)}"
    )
    print(
        table(
            [
                "dtype",
                "KV dtype",
                "block",
                "ms/step",
                "tok/s",
                "weights MiB",
                "K/V MiB",
                "read floor ms",
                "bandwidth eff. %",
                "oneDNN linear ms",
                "other torch ops ms",
                "C kernels + Python ms",
            ],
            rows,
        )
    )
    labels = list(results[0]["breakdown_ms"]) if results else []
    print(
        "\nwhere the step goes, wall ms per step "
        '(each entry point timed; their sum and "rest" make the step):'
    )
    print(
        table(
            ["dtype", "KV dtype", "block", "step", *labels],
            [
                [
                    r["dtype"],
                    r["kv_cache_dtype"],
                    r["block_size"],
                    r["timed_ms"],
                    *(r["breakdown_ms"][k] for k in labels),
                ]
                for r in results
            ],
        )
    )
    write_json(
        args.out,
        {"machine": info, "args": vars(args) | {"out": str(args.out)}, "read_rate": rate, "results": results},
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
