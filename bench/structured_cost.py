#!/usr/bin/env python
"""What structured output costs per decode step, and how long a grammar takes to compile.

    python bench/structured_cost.py

Decode: B requests (8-token prompts, `--tokens` tokens each, EOS ignored) with no constraint and with
every request constrained, side by side in one run on the bench's medium model (bfloat16, 2 threads).
The constraint is a regex that any number of its characters satisfies (`[a-z0-9 ,.:]*`), so every
request still makes exactly `--tokens` tokens and the two runs do the same model work: the difference
is the mask (filled per request per step in the engine, shipped in the step, applied on the worker).
Compile: a 20-property JSON schema through the engine's GrammarCompiler for the medium model's
vocabulary... which has no tokenizer (random token ids), so the bundled default model's tokenizer is
used, cold and cached.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import asyncengine  # noqa: F401  (the installed package first)
from asyncengine.config import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, load_line, machine_info, table  # noqa: E402

REGEX = r"[a-z0-9 ,.:]*"


def decode_rate(model: Path, batch: int, tokens: int, constrained: bool, reps: int) -> float:
    """Median decode tokens/s of `reps` runs."""
    from asyncengine import LLM, SamplingParams
    from asyncengine.structured_output import StructuredOutputsParams

    llm = LLM(model=str(model), dtype="bfloat16", num_threads=2, tokenizer=default_model_path())
    try:
        spec = StructuredOutputsParams(regex=REGEX) if constrained else None
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, structured_outputs=spec)
        prompts = [[(7 * i + j) % 4000 + 3 for j in range(8)] for i in range(batch)]
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=spec))
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - t0
            assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
            rates.append(batch * tokens / seconds)
        return statistics.median(rates)
    finally:
        llm.shutdown()


def compile_times() -> tuple[float, float]:
    from asyncengine.structured_output import GrammarCompiler, StructuredOutputsParams
    from asyncengine.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    compiler = GrammarCompiler(tok, None, [tok.eos_token_id])
    props = {
        f"field_{i}": [{"type": "string"}, {"type": "integer"}, {"enum": ["a", "b"]}, {"type": "boolean"}][
            i % 4
        ]
        for i in range(20)
    }
    spec = StructuredOutputsParams(json={"type": "object", "properties": props, "required": list(props)})
    t0 = time.perf_counter()
    compiler.matcher(spec)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.matcher(spec)
    return cold, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    model = build_model("medium")
    info = machine_info()
    rows = []
    for b in args.batches:
        plain = decode_rate(model, b, args.tokens, False, args.reps)
        masked = decode_rate(model, b, args.tokens, True, args.reps)
        rows.append([f"batch {b}", plain, masked, masked / plain])
    cold, cached = compile_times()
    print(f"\nmedium model, bfloat16, 2 threads, {args.tokens} tokens per request; {load_line(info)}\n")
    print(table(["", "plain tok/s", "constrained tok/s", "ratio"], rows, 3))
    print(f"\n20-property JSON schema compile: cold {cold * 1e3:.1f} ms, cached {cached * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
