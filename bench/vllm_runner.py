#!/usr/bin/env python
"""Offline vLLM runs for bench/throughput.py and bench/sweep.py, executed with bench/vllm_venv/bin/python.

    bench/vllm_venv/bin/python bench/vllm_runner.py --workload in.json --out out.json
    bench/vllm_venv/bin/python bench/vllm_runner.py --workload in.json --serve --result-fd N

in.json: {"model", "dtype", "prompts": [[ids]], "output_lens": [n], "max_num_seqs", "max_num_batched_tokens",
          "max_model_len", "enable_prefix_caching", "warmup": true, "kv_cache_dtype": "auto" | "fp8_e5m2",
          "num_speculative_tokens": 0 (or K: n-gram prompt lookup, lookup lengths 1-3)}
out.json: {"seconds", "token_ids": [[ids]], "load_seconds", "vllm_version", "frontend_torch_threads"}
--serve (bench/vllm_session.py, for bench/sweep.py): in.json has no prompts; once loaded and warm the
runner writes one line {"ready": true, "load_seconds", "vllm_version", "frontend_torch_threads"} to
--result-fd, then reads runs ({"name", "prompts", "output_lens"}), a JSON line each, from stdin and answers
each with a line {"name", "seconds", "token_ids"} on --result-fd until stdin closes. Every run starts with
a cold prefix cache. (Answers go to a pipe of their own: vLLM and its engine process log to stdout.)

Token-id prompts, skip_tokenizer_init=True (the random model directories have no tokenizer), greedy,
ignore_eos, exactly the same output length per request as the other engines. The KV-cache size and the
thread binding come from the environment (VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_NUM_OF_RESERVED_CPU), set by the caller. vLLM needs the __main__ guard (it spawns processes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve", action="store_true", help="runs from stdin, results to --result-fd")
    parser.add_argument("--result-fd", type=int)
    args = parser.parse_args()
    if args.serve != (args.result_fd is not None) or args.serve == (args.out is not None):
        parser.error("either --out, or --serve with --result-fd")
    spec = json.loads(args.workload.read_text())

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        skip_tokenizer_init=True,
        seed=0,
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        speculative_config=(
            {
                "method": "ngram",
                "num_speculative_tokens": spec["num_speculative_tokens"],
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 3,
            }
            if spec.get("num_speculative_tokens")
            else None
        ),
    )
    load_s = time.perf_counter() - t0
    if spec.get("warmup", True):
        # distinct token ids from the workload's, so the warm-up leaves nothing in the prefix cache
        warm = [TokensPrompt(prompt_token_ids=[5 + i] * 24) for i in range(4)]
        llm.generate(
            warm,
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        )

    def run(prompt_ids: list[list[int]], output_lens: list[int]) -> dict:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        # greedy unless the spec names a sampling (bench/sweep.py --temperature / --top-p / --top-k)
        sampling = {"temperature": 0.0, **spec.get("sampling", {})}
        params = [
            SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, **sampling) for n in output_lens
        ]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return {
            "seconds": time.perf_counter() - t0,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        }

    result = {
        "load_seconds": load_s,
        "vllm_version": vllm.__version__,
        "frontend_torch_threads": torch.get_num_threads(),
    }
    if args.serve:
        with open(args.result_fd, "w", buffering=1) as results:  # line-buffered: one flush a line
            results.write(json.dumps({"ready": True, **result}) + "\n")
            for line in sys.stdin:
                r = json.loads(line)
                llm.reset_prefix_cache()
                results.write(json.dumps({"name": r["name"], **run(r["prompts"], r["output_lens"])}) + "\n")
        return 0
    result.update(run(spec["prompts"], spec["output_lens"]))
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
