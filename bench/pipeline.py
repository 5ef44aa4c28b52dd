#!/usr/bin/env python
"""Pipeline-parallel throughput: P=1 vs P=2 side by side, on CPU, one torch thread per worker.

    python bench/pipeline.py                       # ~100M random Llama, 64 concurrent requests
    python bench/pipeline.py --partition 7,5       # P=2 with an explicit layer split (extra row)

The model (hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000, untied LM head: 110M
parameters in the matmuls) is built once with random weights and saved in the cache directory. Every
request has a seeded random prompt (32-128 tokens) and output length (32-64 tokens, EOS ignored); all
are submitted at once, greedily decoded, and timed from submission to the last token. Each engine gets
a short warm-up first. P=1 and P=2 must produce the same tokens (checked). Prints a table and writes
JSON to bench/out/pipeline.json.

The goal is P=2 >= 1.8 x P=1: two stages, each with its own core, only reach that when both are busy
all the time, which takes two batches in flight (the scheduler gives each about half the running
sequences) and stage work that is balanced. NOTE: the last stage also runs the LM head (768 x 32000,
a fifth of the model's FLOPs), so the even 6/6 split caps the speed-up near 1.64x; `--partition 7,5`
shows the balanced split.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import asyncengine  # noqa: F401  (first: the real package, before anything touches sys.path)
from asyncengine import LLM, SamplingParams

HERE = Path(__file__).resolve().parent
MODEL_CONFIG = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                    intermediate_size=2048, vocab_size=32000, max_position_embeddings=1024,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def build_model(path: Path) -> Path:
    """A random ~100M Llama saved with save_pretrained (float32), reused when already there."""
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODEL_CONFIG)
    cfg.architectures = ["LlamaForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_requests(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))])
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(*output_len), ignore_eos=True))
    return prompts, params


def num_steps(llm: LLM) -> int:
    return int(llm.engine.stats.registry.get_sample_value("asyncengine:engine_steps_total") or 0)


def run(model: Path, pp: int, partition: tuple[int, ...] | None, prompts: list[list[int]],
        params: list[SamplingParams], args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(model=str(model), dtype="float32", pipeline_parallel_size=pp, pp_layer_partition=partition,
              num_threads=1, num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False)
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts[: 2 * pp], warm)
        steps0 = num_steps(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        steps = num_steps(llm) - steps0
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    generated = sum(len(t) for t in tokens)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"pp": pp, "partition": list(partition) if partition else None, "seconds": elapsed,
            "output_tokens": generated, "prompt_tokens": prompt_tokens, "output_tok_s": generated / elapsed,
            "total_tok_s": (generated + prompt_tokens) / elapsed, "steps": steps, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=HERE / "out" / "models" / "llama-100m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partition", type=str, default=None,
                        help="also run P=2 with this layer split, e.g. 7,5 (the first stage gets 7 layers)")
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=HERE / "out" / "pipeline.json")
    args = parser.parse_args(argv)

    model = build_model(args.model_dir)
    prompts, params = make_requests(args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                                    MODEL_CONFIG["vocab_size"], args.seed)
    configs: list[tuple[int, tuple[int, ...] | None]] = [(1, None), (2, None)]
    if args.partition:
        configs.append((2, tuple(int(x) for x in args.partition.split(","))))
    results = []
    for pp, partition in configs:
        print(f"running P={pp} {partition or ''} ...", file=sys.stderr, flush=True)
        results.append(run(model, pp, partition, prompts, params, args))
    base = results[0]
    identical = all(r["tokens"] == base["tokens"] for r in results[1:])

    print(f"\n{args.num_requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, 1 thread per worker, {os.cpu_count()} cores")
    print(f"{'config':<16}{'seconds':>9}{'out tok/s':>11}{'total tok/s':>13}{'vs P=1':>8}")
    for r in results:
        name = f"P={r['pp']}" + (f" ({','.join(map(str, r['partition']))})" if r["partition"] else "")
        ratio = r["output_tok_s"] / base["output_tok_s"]
        print(f"{name:<16}{r['seconds']:>9.2f}{r['output_tok_s']:>11.1f}{r['total_tok_s']:>13.1f}{ratio:>7.2f}x")
    print(f"greedy tokens identical across configs: {'yes' if identical else 'NO'}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": MODEL_CONFIG, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "seed": args.seed, "cpu_count": os.cpu_count(),
              "platform": platform.platform(), "identical": identical,
              "ratio_p2_p1": results[1]["output_tok_s"] / base["output_tok_s"],
              "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results]}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
