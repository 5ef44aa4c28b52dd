#!/usr/bin/env python
"""Grammar engines for structured output (issue 22): xgrammar against llguidance on this CPU.

    python bench/grammar_backends.py                   # both engines, the default model's vocab and a
                                                       # 128k vocab trained here; table + JSON
    python bench/grammar_backends.py --vocab default   # the bundled model's tokenizer only
    python bench/grammar_backends.py --repeats 10

Each (engine, vocab) pair runs in a fresh interpreter, so the import cost and whether the engine imports
torch ("torch" in sys.modules right after `import xgrammar` / `import llguidance, llguidance.numpy`)
are that engine's own. Measured per pair: the import; the tokenizer info (xgrammar's TokenizerInfo,
llguidance's LLTokenizer) for the vocabulary; per grammar (JSON schemas: a simple object, a nested one
with arrays, enums and a pattern, the tool-call array that tool_choice="required" constrains to, any
JSON object; a regex; a choice list; a GBNF grammar): the compile time (median of --repeats, caches
off); the first request on a fresh compile, compile plus all its mask fills over a valid token sequence
(the tokenizer's encoding of a matching text): what a schema seen for the first time costs, lazy work
included (tool schemas differ per request); then, over the later requests, the per-token mask fill and
accept times; and a batch of 16 requests filling their masks at once (xgrammar's BatchGrammarMatcher,
llguidance's LLExecutor) with 2 threads. The engine must allow every token of the sequence and EOS
at its end ("valid" column). Last, the worker's half: asyncengine.layers.grammar_mask applying masks
to CPU logits (torch).

The bigger vocabulary: no tokenizer may be downloaded here, so a byte-level BPE of up to 128,000 tokens
is trained (tokenizers' BpeTrainer, about 10 s, cached in bench/out/grammar_vocab_128k/) on this
Python's standard library, which yields 122,700 tokens; real 128k vocabularies (Llama 3) hold more
multi-byte and non-code tokens, so take its mask times as indicative. Writes
bench/out/grammar_backends.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
DEFAULT_MODEL = HERE.parent / "asyncengine" / "assets" / "default-model"
BIG_VOCAB_DIR = OUT / "grammar_vocab_128k"
BIG_VOCAB = 128_000
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 in both vocabularies
EOS_IDS = [0, 2]  # the default model's generation_config.json
BATCH = 16

SIMPLE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
NESTED = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                    "tags": {"type": "array", "items": {"enum": ["gift", "fragile", "bulk"]}},
                },
                "required": ["sku", "qty", "price"],
            },
        },
    },
    "required": ["order_id", "status", "customer", "items"],
}
TOOL_CALLS = {  # what asyncengine.entrypoints.tool_parsers builds for tool_choice="required"
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": "get_weather"},
                    "arguments": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string"},
                            "unit": {"enum": ["celsius", "fahrenheit"]},
                        },
                        "required": ["city"],
                    },
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "name": {"const": "search"},
                    "arguments": {
                        "type": "object",
                        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                        "required": ["query"],
                    },
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            },
        ]
    },
}
REGEX = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]) [A-Z][a-z]+( [A-Z][a-z]+)*"
CHOICES = ["positive", "negative", "neutral", "mixed", "sarcastic", "angry", "joyful", "unknown"]
GBNF = r"""root ::= "SELECT " columns " FROM " ident where? ";"
columns ::= "*" | ident (", " ident)*
where ::= " WHERE " cond (" AND " cond)*
cond ::= ident " " op " " value
op ::= "=" | "<" | ">" | "<=" | ">=" | "!="
value ::= [0-9]+ | "'" [a-zA-Z0-9 ]* "'"
ident ::= [a-z_] [a-z0-9_]*
"""


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


# name -> (kind, spec, a matching text)
CASES: dict[str, tuple[str, Any, str]] = {
    "json simple": ("json", SIMPLE, compact({"name": "Ada Lovelace", "age": 36})),
    "json nested": (
        "json",
        NESTED,
        compact(
            {
                "order_id": "ABC-1234",
                "status": "shipped",
                "customer": {"name": "Grace Hopper", "vip": True},
                "items": [
                    {"sku": "kb-87", "qty": 2, "price": 49.95, "tags": ["gift", "fragile"]},
                    {"sku": "mouse-3", "qty": 1, "price": 19.5},
                ],
            }
        ),
    ),
    "json tool calls": (
        "json",
        TOOL_CALLS,
        compact(
            [
                {"name": "get_weather", "arguments": {"city": "Amsterdam", "unit": "celsius"}},
                {"name": "search", "arguments": {"query": "tram timetable line 2", "limit": 5}},
            ]
        ),
    ),
    "json object (any)": (
        "json",
        {"type": "object"},
        compact({"title": "Report", "pages": [1, 2, 3], "meta": {"draft": False, "score": -0.5}}),
    ),
    "regex": ("regex", REGEX, "2026-12-04 Amsterdam Centraal"),
    "choice (8)": ("choice", CHOICES, "sarcastic"),
    "GBNF (SQL subset)": ("gbnf", GBNF, "SELECT name, age FROM users WHERE age >= 18 AND country = 'NL';"),
}
BATCH_CASES = ("json nested", "json tool calls", "json object (any)", "GBNF (SQL subset)")


# -- vocabularies ----------------------------------------------------------------------------------
def big_vocab_tokenizer() -> Path:
    """A 128k byte-level BPE trained on this Python's standard library (no download), cached."""
    path = BIG_VOCAB_DIR / "tokenizer.json"
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for f in sorted(stdlib.rglob("*.py")):
        if "site-packages" in f.parts:
            continue
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BIG_VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t0 = time.perf_counter()
    tok.train_from_iterator(texts, trainer)
    print(f"trained a {tok.get_vocab_size()}-token BPE in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def tokenizer_path(vocab: str) -> Path:
    return DEFAULT_MODEL / "tokenizer.json" if vocab == "default" else big_vocab_tokenizer()


# -- one engine, in its own interpreter ------------------------------------------------------------
def us(ns: list[int]) -> dict[str, float]:
    vals = sorted(v / 1000 for v in ns)
    return {
        "mean": statistics.fmean(vals),
        "p50": vals[len(vals) // 2],
        "p99": vals[min(len(vals) - 1, int(len(vals) * 0.99))],
    }


def allowed(mask_row: Any, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


class XGrammar:
    def __init__(self) -> None:
        import xgrammar

        self.xgr = xgrammar

    def tokenizer_info(self, path: Path, vocab_size: int) -> Any:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if path.parent == DEFAULT_MODEL:
            hf = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
        else:
            hf = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=SPECIALS[0])
        t0 = time.perf_counter()
        info = self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=EOS_IDS)
        return info, time.perf_counter() - t0

    def compile(self, info: Any, kind: str, spec: Any) -> Any:
        compiler = self.xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":  # no choice type: an EBNF alternation, as vLLM does
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
        return compiler.compile_grammar(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int, vocab_size: int) -> Any:
        return self.xgr.allocate_token_bitmask(rows, vocab_size).numpy()  # shares memory with the tensor

    def fill(self, matcher: Any, bitmask: Any, row: int = 0) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def batch(self) -> Any:
        return self.xgr.BatchGrammarMatcher(max_threads=2)

    def batch_fill(self, batcher: Any, matchers: list[Any], bitmask: Any) -> None:
        batcher.batch_fill_next_token_bitmask(matchers, bitmask)


class LLGuidance:
    def __init__(self) -> None:
        import llguidance
        import llguidance.numpy

        self.llg = llguidance
        self.np = llguidance.numpy

    def tokenizer_info(self, path: Path, vocab_size: int) -> Any:
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(path)).to_str()
        t0 = time.perf_counter()
        info = self.llg.LLTokenizer(raw, n_vocab=vocab_size, eos_token=EOS_IDS)
        return info, time.perf_counter() - t0

    def compile(self, info: Any, kind: str, spec: Any) -> Any:
        """llguidance has no compiled-grammar object: the matcher is built from the grammar (lexer and
        parser tables, lazily filled), and a cache keeps a pristine matcher to deep_copy per request."""
        if kind == "json":
            grammar = self.llg.LLMatcher.grammar_from_json_schema(spec)
        else:
            grammar = self.llg.grammar_from(kind, json.dumps(spec) if kind == "choice" else spec)
        matcher = self.llg.LLMatcher(info, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def bitmask(self, rows: int, vocab_size: int) -> Any:
        return self.np.allocate_token_bitmask(rows, vocab_size)

    def fill(self, matcher: Any, bitmask: Any, row: int = 0) -> None:
        self.np.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def batch(self) -> Any:
        return self.llg.LLExecutor(num_threads=2)

    def batch_fill(self, batcher: Any, matchers: list[Any], bitmask: Any) -> None:
        self.np.fill_next_token_bitmask_par(batcher, [(m, i) for i, m in enumerate(matchers)], bitmask)


def run_child(engine_name: str, vocab: str, repeats: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    path = tokenizer_path(vocab)  # before the clock: the 128k training is not the engine's
    tok = Tokenizer.from_file(str(path))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    t0 = time.perf_counter()
    engine = XGrammar() if engine_name == "xgrammar" else LLGuidance()
    result: dict[str, Any] = {
        "engine": engine_name,
        "vocab": vocab,
        "vocab_size": vocab_size,
        "import_s": time.perf_counter() - t0,
        "imports_torch": "torch" in sys.modules,
        "imports_transformers": "transformers" in sys.modules,
    }
    import importlib.metadata

    result["version"] = importlib.metadata.version(engine_name)
    info, result["tokenizer_info_s"] = engine.tokenizer_info(path, vocab_size)
    result["cases"] = {}
    compiled: dict[str, Any] = {}
    for name, (kind, spec, text) in CASES.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled[name] = engine.compile(info, kind, spec)
            times.append(time.perf_counter() - t0)
        tokens = tok.encode(text, add_special_tokens=False).ids
        bitmask = engine.bitmask(1, vocab_size)
        first_request_ns = 0  # all mask fills of the first request on the fresh compile (lazy work)
        fill_ns: list[int] = []  # the later requests' per-token fills
        accept_ns: list[int] = []
        valid = True
        first_mask_ms = 0.0
        for run in range(repeats):
            t0 = time.perf_counter()
            matcher = engine.matcher(compiled[name])
            engine.fill(matcher, bitmask)
            if run == 0:
                first_mask_ms = (time.perf_counter() - t0) * 1000
                first_request_ns += int(first_mask_ms * 1e6)
            for i, token in enumerate(tokens):
                if i:
                    t0 = time.perf_counter_ns()
                    engine.fill(matcher, bitmask)
                    elapsed = time.perf_counter_ns() - t0
                    if run == 0:
                        first_request_ns += elapsed
                    else:
                        fill_ns.append(elapsed)
                valid &= allowed(bitmask[0], token)
                t0 = time.perf_counter_ns()
                valid &= engine.accept(matcher, token)
                accept_ns.append(time.perf_counter_ns() - t0)
            engine.fill(matcher, bitmask)
            valid &= all(allowed(bitmask[0], e) for e in EOS_IDS)
        result["cases"][name] = {
            "tokens": len(tokens),
            "compile_ms": statistics.median(times) * 1000,
            # a schema seen for the first time (tool schemas differ per request): compile, then its masks
            "first_request_ms": times[-1] * 1000 + first_request_ns / 1e6,
            "first_mask_ms": first_mask_ms,
            "fill_us": us(fill_ns),
            "accept_us": us(accept_ns),
            "valid": valid,
        }
    # a batch of 16 requests, each on its own grammar and text, all advancing one token per step
    rows = [BATCH_CASES[i % len(BATCH_CASES)] for i in range(BATCH)]
    seqs = [tok.encode(CASES[n][2], add_special_tokens=False).ids for n in rows]
    steps = min(len(s) for s in seqs)
    bitmask = engine.bitmask(BATCH, vocab_size)
    batcher = engine.batch()
    batch_ns: list[int] = []
    for _ in range(repeats):
        matchers = [engine.matcher(compiled[n]) for n in rows]
        for step in range(steps):
            t0 = time.perf_counter_ns()
            engine.batch_fill(batcher, matchers, bitmask)
            if step:  # the first step of each repeat holds lazy first-mask work
                batch_ns.append(time.perf_counter_ns() - t0)
            for m, s in zip(matchers, seqs):
                assert engine.accept(m, s[step])
    result["batch16_fill_us"] = us(batch_ns)
    result["batch16_steps"] = steps
    result["imports_torch_at_end"] = "torch" in sys.modules
    return result


# -- the worker's half -----------------------------------------------------------------------------------
def apply_figures(repeats: int) -> list[tuple[int, int, int, float, float]]:
    """asyncengine.layers.grammar_mask.apply_token_bitmask_ on CPU logits: (masked rows, batch rows,
    vocab, median ms, min ms). Random masks; the cost does not depend on the bits."""
    import torch

    sys.path.insert(0, str(HERE.parent))
    from asyncengine.layers.grammar_mask import apply_token_bitmask_

    torch.set_num_threads(1)  # 2 threads on 2 busy cores measured the other sessions' load, not this
    out = []
    for vocab in (4096, BIG_VOCAB):
        for masked, total in ((1, 8), (8, 64), (64, 64)):
            logits = torch.randn(total, vocab)
            bitmask = torch.randint(-(2**31), 2**31 - 1, (masked, (vocab + 31) // 32), dtype=torch.int32)
            rows = list(range(0, total, total // masked))[:masked] if masked < total else None
            apply_token_bitmask_(logits, bitmask, rows)  # the byte table, once
            times = []
            for _ in range(max(repeats, 5)):
                t0 = time.perf_counter()
                apply_token_bitmask_(logits, bitmask, rows)
                times.append(time.perf_counter() - t0)
            out.append((masked, total, vocab, statistics.median(times) * 1000, min(times) * 1000))
    return out


# -- the comparison ----------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"]
    out.append("| " + " | ".join("-" * w for w in widths) + " |")
    for r in rows:
        out.append(
            "| "
            + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            + " |"
        )
    return "\n".join(out)


def spread(t: dict[str, float]) -> str:
    return f"{t['p50']:.1f} / {t['mean']:.1f} / {t['p99']:.0f}"


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def report(results: list[dict[str, Any]]) -> str:
    vocabs = sorted({r["vocab"] for r in results}, key=lambda v: v != "default")
    parts = []
    for vocab in vocabs:
        pair = {r["engine"]: r for r in results if r["vocab"] == vocab}
        engines = [e for e in ("xgrammar", "llguidance") if e in pair]
        any_r = pair[engines[0]]
        headers = ["metric", *(f"{e} {pair[e]['version']}" for e in engines)]
        rows = [
            ["import (s)", *(f"{pair[e]['import_s']:.2f}" for e in engines)],
            [
                "imports torch / transformers",
                *(
                    f"{yes(pair[e]['imports_torch'])} / {yes(pair[e]['imports_transformers'])}"
                    for e in engines
                ),
            ],
            ["tokenizer info (ms)", *(f"{pair[e]['tokenizer_info_s'] * 1000:.1f}" for e in engines)],
        ]
        for name in CASES:
            c = {e: pair[e]["cases"][name] for e in engines}
            rows.append(
                [
                    f"{name} ({c[engines[0]]['tokens']} tok): compile ms",
                    *(f"{c[e]['compile_ms']:.2f}" for e in engines),
                ]
            )
            rows.append(
                [
                    "  first request: compile + its masks (ms)",
                    *(f"{c[e]['first_request_ms']:.2f}" for e in engines),
                ]
            )
            rows.append(
                [
                    "  later requests: mask us/token median / mean / p99",
                    *(spread(c[e]["fill_us"]) for e in engines),
                ]
            )
            rows.append(
                [
                    "  accept us/token median / mean",
                    *(f"{c[e]['accept_us']['p50']:.1f} / {c[e]['accept_us']['mean']:.1f}" for e in engines),
                ]
            )
            rows.append(
                ["  valid (all tokens + EOS allowed)", *("yes" if c[e]["valid"] else "NO" for e in engines)]
            )
        rows.append(
            [
                f"batch of {BATCH}, 2 threads: fill us/step mean (p99)",
                *(
                    f"{pair[e]['batch16_fill_us']['mean']:.0f} ({pair[e]['batch16_fill_us']['p99']:.0f})"
                    for e in engines
                ),
            ]
        )
        parts.append(f"vocab {vocab}: {any_r['vocab_size']} tokens\n\n" + table(headers, rows))
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", choices=["default", "128k", "both"], default="both")
    parser.add_argument("--engines", default="xgrammar,llguidance")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child[0], args.child[1], args.repeats)))
        return
    vocabs = ["default", "128k"] if args.vocab == "both" else [args.vocab]
    if "128k" in vocabs:
        big_vocab_tokenizer()  # once, before any child is timed
    results = []
    load = os.getloadavg()
    for vocab in vocabs:
        for engine in args.engines.split(","):
            out = subprocess.run(
                [sys.executable, __file__, "--child", engine, vocab, "--repeats", str(args.repeats)],
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode != 0:
                sys.exit(f"{engine} on {vocab}: exit {out.returncode}\n{out.stderr}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    applied = apply_figures(args.repeats)
    info = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_before": [round(x, 2) for x in load],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    OUT.mkdir(parents=True, exist_ok=True)
    data = {"info": info, "results": results, "apply": applied}
    (OUT / "grammar_backends.json").write_text(json.dumps(data, indent=2))
    print(json.dumps(info))
    print(report(results))
    print()
    print(
        table(
            ["worker side: apply_token_bitmask_ (torch, CPU, 1 thread)", "ms per call: median (min)"],
            [
                [f"{rows} masked rows of {total}, vocab {vocab}", f"{ms:.3f} ({best:.3f})"]
                for rows, total, vocab, ms, best in applied
            ],
        )
    )


if __name__ == "__main__":
    main()
