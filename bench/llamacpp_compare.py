#!/usr/bin/env python
"""llama.cpp at bf16/f16, Q8_0 and Q4_0 against asyncengine's decode at bfloat16, int8 and int4, on CPU.

One run, the bench's medium random Llama (hidden 768, 12 layers, vocab 32000; 134M parameters with the
embedding and the LM head) at batch 1 and 16:

1. the model (bench/common.py) and its GPTQ int4 checkpoint (bench/quant_gemm.py) are built or reused;
2. the float32 safetensors are written as an f32 GGUF by this script (see "Conversion" below), then
   `llama-quantize` makes the f16, bf16, Q8_0 and Q4_0 GGUFs (cached in bench/out/models/medium-gguf/);
3. `llama-batched-bench` (128-token prompts, `--steps` generated, 1 or 16 parallel sequences, one prompt
   per sequence, `-t/-tb --threads`, -c just large enough) runs each GGUF, one process per batch size and
   repeat; its S_TG (generated tokens / decode time) is the llama.cpp figure. f16 and bf16 both run; the
   faster (geometric mean over the two batches) is the float format compared with asyncengine's bfloat16
   and the 16-bit type of the quantized GGUFs' LM head and embedding (see below);
4. asyncengine decodes the same shapes through a ModelRunner (bench/gpu_check.py's decode_throughput:
   128-token prefill, then `--steps` greedy steps) as bfloat16, `--quantization int8` and GPTQ int4,
   interleaved with the llama.cpp runs (llama.cpp f16, bf16, ours bf16, Q8_0, ours int8, Q4_0, ours int4,
   then llama-quantize's default mixes) so that load drift moves both sides of a pair alike. Every
   figure is the best of `--repeats` runs, each started after a second with >= 90% of the CPUs idle
   (waiting up to `--quiet-wait` s): on 2 cores a busy neighbour stalls a 2-thread run's barriers, and
   llama.cpp's spinning thread pool fell from 130 to 8 tok/s at batch 1 when that happened;
5. a table of asyncengine tok/s, llama.cpp tok/s and their ratio per format pair and batch, with the
   weight bytes of the decoder layers' linear weights of both (asyncengine: as loaded, scales, zero
   points and padding included, quant_gemm.linear_weight_bytes; llama.cpp: the same tensors' bytes in
   the GGUF, block scales included) and the GGUF file size (everything: embedding, LM head, norms);
6. a check that the GGUF is the same network: greedy tokens and first-step logits of llama.cpp (the
   sdist's ctypes bindings on the libllama built by bench/setup_llamacpp.sh) against HF transformers in
   float32 on the same safetensors, for a fixed prompt of token ids. Reported, never fatal.

    bash bench/setup_llamacpp.sh              # once: builds llama.cpp's tools into bench/llamacpp/
    python bench/llamacpp_compare.py          # 2 threads, 32 decode steps, best of 3 repeats
    python bench/llamacpp_compare.py --threads 1 --repeats 1
Writes bench/out/llamacpp_compare.json (logs of the llama.cpp tools in bench/out/llamacpp/).

Formats are not the same quantization: llama.cpp's Q8_0 is symmetric int8 with one fp16 scale per block
of 32 weights (8.5 bits per weight) and Q4_0 symmetric 4-bit with one fp16 scale per block of 32
(4.5 bits per weight); asyncengine's int8 is symmetric per output channel (8 bits + one float32 scale a
row) and its int4 is GPTQ group 128 (4 bits + an fp16 scale and a 4-bit zero per 128). asyncengine keeps
the LM head and the embedding in bfloat16 in all three; so the "matched" Q8_0 / Q4_0 GGUFs here get
`--output-tensor-type` / `--token-embedding-type` set to the 16-bit float type (llama-quantize's defaults,
also run and shown in the second table, make the LM head Q8_0 for Q8_0 and Q6_K for Q4_0).
llama.cpp's own defaults otherwise: weight repacking on (here the Q4_0 linears are repacked to
q4_0_8x8; Q8_0 and the 16-bit types are not), flash attention "auto" (it resolves to on; `-fa off` and a
unified KV cache `-kvu` were 20-30% slower at batch 16 in a spot check), mmap, non-unified KV cache.
llama-batched-bench computes the logits of each step but samples nothing; asyncengine's step includes
its greedy pick. Its JSON lines are printed by llama.cpp's log thread, which now and then loses the last
line at exit: such a run is rerun (counted as lost_lines in the JSON).

Conversion: bench/common.py saves only config.json, generation_config.json and model.safetensors (no
tokenizer), and llama.cpp's convert_hf_to_gguf.py refuses it (for a Llama it wants a sentencepiece
tokenizer.model, then tokenizer.json). Decode speed does not depend on the vocabulary, so this script
writes the GGUF itself with the gguf-py vendored in the same llama.cpp source (`gguf.GGUFWriter`): the
llama metadata from config.json, the tensors under llama.cpp's names, q_proj / k_proj rows permuted the
way convert_hf_to_gguf.py does (HF's rotate-half RoPE layout to llama.cpp's interleaved one), and a
minimal sentencepiece-style ("llama") vocabulary of 32000 made-up pieces: <unk>, <s>, </s>, the 256 byte
tokens <0x00>..<0xFF> (llama.cpp looks up the newline byte), then t259..t31999. It is float32, so the
quantized GGUFs are quantized from the original weights, not from a 16-bit copy.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import random
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HERE, MODELS, OUT, build_model, load_line, machine_info, started, table, write_json  # noqa: E402

LLAMACPP = HERE / "llamacpp"
BIN = LLAMACPP / "build" / "bin"
SRC = LLAMACPP / "src" / "current"  # the unpacked llama-cpp-python sdist (a link made by the setup)
GGUF_DIR = MODELS / "medium-gguf"
LOGS = OUT / "llamacpp"
TOOLS = ("llama-quantize", "llama-batched-bench")
PROMPT = 128
BATCHES = (1, 16)
CHECK_PROMPT, CHECK_TOKENS = 32, 24  # the greedy check: prompt ids, generated tokens
LINEAR_SUFFIXES = tuple(
    f"{t}.weight" for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
)


# -- GGUF files -------------------------------------------------------------------------------------
def import_gguf() -> Any:
    """The gguf-py of the llama.cpp that was built (a pip-installed `gguf` would do too)."""
    sys.path.insert(0, str(SRC / "vendor" / "llama.cpp" / "gguf-py"))
    return importlib.import_module("gguf")


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's q/k rows (rotate-half pairs i, i + d/2) to
    llama.cpp's interleaved pairs (2i, 2i + 1), head by head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_f32(model_dir: Path, dst: Path) -> Path:
    """The HF Llama in model_dir as a float32 GGUF with a made-up vocabulary (module docstring)."""
    if dst.exists():
        return dst
    from safetensors.torch import load_file

    gguf = import_gguf()
    cfg = json.loads((model_dir / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    assert rope.get("rope_type", "default") == "default", rope
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    h, n_head, n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    vocab = cfg["vocab_size"]
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(model_dir.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(cfg.get("head_dim") or h // n_head)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tt = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types_ = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL] + [tt.BYTE] * 256
    tokens += [f"t{i}" for i in range(len(tokens), vocab)]
    types_ += [tt.NORMAL] * (vocab - len(types_))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(vocab)])
    w.add_token_types(types_)
    w.add_unk_token_id(0)
    w.add_bos_token_id(cfg.get("bos_token_id", 1))
    w.add_eos_token_id(cfg.get("eos_token_id", 2))
    w.add_add_bos_token(False)
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    top["lm_head.weight"] = "output.weight"
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        t = t.float()
        if name in top:
            out = top[name]
        else:
            parts = name.split(".")  # model.layers.<i>.<module...>.weight
            if parts[:2] != ["model", "layers"] or parts[-1] != "weight":
                raise ValueError(f"no GGUF name for {name}")
            out = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.weight"
            if name.endswith("q_proj.weight"):
                t = permute_rope(t, n_head)
            elif name.endswith("k_proj.weight"):
                t = permute_rope(t, n_kv)
        w.add_tensor(out, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)  # a half-written file is never reused
    return dst


class ToolCrashed(RuntimeError):
    """A llama.cpp tool killed by a signal (a negative exit status)."""


def run_tool(cmd: list[str], log: Path, timeout_s: float = 900) -> str:
    """Runs a llama.cpp tool to completion (its whole process group killed on any error); its output."""
    with started(cmd, log=log) as proc:
        rc = proc.wait(timeout_s)
    text = log.read_text(errors="replace")
    if rc != 0:
        error = ToolCrashed if rc < 0 else RuntimeError
        raise error(f"{' '.join(cmd)} exited with {rc}; see {log}:\n{text[-2000:]}")
    return text


def quantize(src: Path, qtype: str, threads: int, tensor_type: str | None = None) -> tuple[Path, list[str]]:
    """llama-quantize src to qtype (`tensor_type`: the LM head's and the embedding's type; None: the
    tool's defaults), cached by name. Returns the file and the command (recorded even when cached)."""
    suffix = f"-out_{tensor_type.lower()}" if tensor_type else ""
    dst = GGUF_DIR / f"medium-{qtype.lower()}{suffix}.gguf"
    extra = []
    if tensor_type:
        extra = ["--output-tensor-type", tensor_type, "--token-embedding-type", tensor_type]
    cmd = [str(BIN / "llama-quantize"), *extra, str(src), str(dst), qtype, str(threads)]
    if not dst.exists():
        tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
        run_tool([*cmd[:-3], str(tmp), *cmd[-2:]], LOGS / f"quantize-{dst.stem}.log")
        tmp.replace(dst)
    return dst, cmd


def gguf_facts(path: Path) -> dict[str, Any]:
    """File size, the decoder linear weights' bytes and the tensor types of a GGUF."""
    gguf = import_gguf()
    reader = gguf.GGUFReader(str(path))
    linear = 0
    kinds: dict[str, str] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if t.name.endswith(LINEAR_SUFFIXES):
            linear += int(t.n_bytes)
            kinds.setdefault("linear", kind)
            if kinds["linear"] != kind:
                kinds["linear"] = "mixed"
        elif t.name in ("output.weight", "token_embd.weight"):
            kinds[t.name.split(".")[0]] = kind
    return {"file_bytes": path.stat().st_size, "linear_bytes": linear, "types": kinds}


# -- quiet windows ----------------------------------------------------------------------------------
def cpu_idle(seconds: float = 1.0) -> float:
    """Fraction of all cores idle over `seconds` (/proc/stat)."""

    def sample() -> tuple[int, int]:
        vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return vals[3] + vals[4], sum(vals[:8])  # idle + iowait, total (guest time is inside user)

    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_quiet(max_wait_s: float, need: float = 0.9) -> float:
    """Waits (up to max_wait_s) for a second in which >= `need` of the CPUs were idle: with 2 threads on
    2 cores, any other busy process stalls both engines' thread barriers (llama.cpp's spinning pool
    most: 8 instead of 130 tok/s seen at batch 1). Returns the last idle fraction seen."""
    if max_wait_s <= 0:
        return float("nan")
    deadline = time.monotonic() + max_wait_s
    idle = cpu_idle()
    while idle < need and time.monotonic() < deadline:
        idle = cpu_idle()
    return idle


# -- llama.cpp speed --------------------------------------------------------------------------------
def speeds(tok_s: dict[int, float]) -> str:
    return ", ".join(f"batch {b} {v:.1f} tok/s" for b, v in tok_s.items())


def batched_bench_cmd(path: Path, batch: int, threads: int, steps: int) -> list[str]:
    ctx = max(256, 2 ** math.ceil(math.log2(batch * (PROMPT + steps))))  # every sequence its prompt + output
    return [
        str(BIN / "llama-batched-bench"),
        *("-m", str(path), "-c", str(ctx), "-b", "2048", "-ub", "512"),
        *("-npp", str(PROMPT), "-ntg", str(steps), "-npl", str(batch)),
        *("-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"),
    ]


def batched_bench(path: Path, threads: int, steps: int, repeats: int, quiet_s: float) -> dict[str, Any]:
    """S_TG (decode tokens/s) per batch: the best of `repeats` runs, one process each, each after a
    quiet second (wait_quiet)."""
    out: dict[str, Any] = {
        "tok_s": {},
        "prefill_tok_s": {},
        "all_tok_s": {},
        "idle_before": {},
        "commands": {},
    }
    for b in BATCHES:
        cmd = batched_bench_cmd(path, b, threads, steps)
        log = LOGS / f"batched-bench-{path.stem}-b{b}.log"
        runs = []
        for _ in range(repeats):
            out["idle_before"].setdefault(b, []).append(round(wait_quiet(quiet_s), 2))
            for _attempt in range(3):  # its log thread now and then loses the last line at exit: rerun
                try:
                    text = run_tool(cmd, log)
                except ToolCrashed:
                    # llama.cpp 0c1e570's repacked weights (its AMX path on a CPU with AMX) segfault on
                    # Q8_0 for this model: rerun without repacking (-nr), and say so in the output
                    if "-nr" in cmd:
                        raise
                    cmd = [*cmd, "-nr"]
                    out.setdefault("no_repack", []).append(b)
                    print(f"llama.cpp crashed on {path.name} at batch {b}: rerun with -nr (no repacking)")
                    text = run_tool(cmd, log)
                rows = [json.loads(ln) for ln in text.splitlines() if ln.startswith('{"n_kv_max"')]
                if rows:
                    break
                out["lost_lines"] = out.get("lost_lines", 0) + 1
            else:
                raise RuntimeError(f"no result line in {log}")
            runs.append(rows[-1])
        out["tok_s"][b] = max(r["speed_tg"] for r in runs)
        out["prefill_tok_s"][b] = max(r["speed_pp"] for r in runs)
        out["all_tok_s"][b] = [round(r["speed_tg"], 2) for r in runs]
        out["commands"][b] = " ".join(cmd)
    return out


def llamacpp_version() -> str:
    with contextlib.suppress(Exception):
        text = run_tool([str(BIN / "llama-batched-bench"), "--version"], LOGS / "version.log", 60)
        return " ".join(ln.strip() for ln in text.splitlines() if ln.startswith(("version", "built")))
    return "unknown"


# -- asyncengine speed ------------------------------------------------------------------------------
def asyncengine_run(path: Path, q: str | None, steps: int, repeats: int, quiet_s: float) -> dict[str, Any]:
    """gpu_check.decode_throughput at each batch: the best of `repeats`, each after a quiet second."""
    from gpu_check import decode_throughput
    from quant_gemm import linear_weight_bytes

    out: dict[str, Any] = {"tok_s": {}, "all_tok_s": {}, "idle_before": {}}
    for b in BATCHES:
        runs = []
        for _ in range(repeats):
            out["idle_before"].setdefault(b, []).append(round(wait_quiet(quiet_s), 2))
            runs.append(decode_throughput(path, b, False, steps, device="cpu", quantization=q))
        out["tok_s"][b] = max(runs)
        out["all_tok_s"][b] = [round(r, 2) for r in runs]
    out["linear_bytes"] = linear_weight_bytes(path, q)
    return out


# -- same network? ----------------------------------------------------------------------------------
def check_prompt(vocab: int) -> list[int]:
    rng = random.Random("llamacpp-check")
    return [rng.randrange(3, vocab) for _ in range(CHECK_PROMPT)]


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF transformers, float32: n greedy tokens and the first step's logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    toks: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        first = out.logits[0, -1].clone()
        for _ in range(n):
            toks.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return toks, first


def llama_bindings() -> Any:
    """llama-cpp-python's ctypes module from the same sdist, on the libllama built here. Its package
    __init__ (the high-level API, which wants diskcache) is skipped: only llama_cpp.llama_cpp loads."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(BIN)
    if "llama_cpp" not in sys.modules:
        pkg = types.ModuleType("llama_cpp")
        pkg.__path__ = [str(SRC / "llama_cpp")]
        sys.modules["llama_cpp"] = pkg
    return importlib.import_module("llama_cpp.llama_cpp")


def llamacpp_greedy(lib: Any, path: Path, prompt: list[int], n: int, threads: int) -> tuple[list[int], Any]:
    """llama.cpp: n greedy tokens (argmax of the logits) and the first step's logits."""
    import numpy as np

    model_params = lib.llama_model_default_params()
    # no weight repacking: this llama.cpp's repacked Q8_0 / Q4_0 (its AMX path) segfaults on this model on an
    # AMX CPU, in this process too (the check's tokens do not depend on it)
    model_params.use_extra_bufts = False
    model = lib.llama_model_load_from_file(str(path).encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    params = lib.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 256
    params.n_threads = params.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, params)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    try:
        toks: list[int] = []
        feed = list(prompt)
        first = None
        for _ in range(n):
            arr = (lib.llama_token * len(feed))(*feed)
            if lib.llama_decode(ctx, lib.llama_batch_get_one(arr, len(feed))) != 0:
                raise RuntimeError("llama_decode failed")
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
            if first is None:
                first = logits
            toks.append(int(logits.argmax()))
            feed = [toks[-1]]
        return toks, first
    finally:
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def same_network(model_dir: Path, ggufs: dict[str, Path], threads: int) -> dict[str, Any]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = check_prompt(vocab)
    ref, ref_logits = hf_greedy(model_dir, prompt, CHECK_TOKENS)
    lib = llama_bindings()
    quiet = lib.llama_log_callback(lambda level, text, data: None)  # kept alive until the end
    lib.llama_log_set(quiet, None)
    lib.llama_backend_init()
    scale = float(ref_logits.std())
    result: dict[str, Any] = {"prompt": prompt, "hf_tokens": ref, "hf_distinct": len(set(ref))}
    for name, path in ggufs.items():
        toks, logits = llamacpp_greedy(lib, path, prompt, CHECK_TOKENS, threads)
        agree = next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), len(ref))
        diff = float((torch.from_numpy(logits) - ref_logits).abs().max())
        result[name] = {"tokens": toks, "agree_prefix": agree, "max_logit_diff_over_std": diff / scale}
        print(
            f"greedy check {name}: first {agree}/{len(ref)} tokens as HF float32, first-step logits "
            f"max |diff| {diff / scale:.3f} std"
        )
    lib.llama_backend_free()
    del quiet
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="each measurement's best of this many")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=60,
        help="max seconds to wait for idle CPUs before a run (0: never)",
    )
    parser.add_argument("--skip-check", action="store_true", help="no greedy HF/llama.cpp comparison")
    args = parser.parse_args()
    missing = [t for t in TOOLS if not (BIN / t).exists()]
    if missing or not (SRC / "llama_cpp").is_dir():
        what = ", ".join(missing) or "sources"
        print(f"llama.cpp tools missing ({what}): run `bash bench/setup_llamacpp.sh` first")
        return 1
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(load_line(info))
    LOGS.mkdir(parents=True, exist_ok=True)
    GGUF_DIR.mkdir(parents=True, exist_ok=True)

    medium = build_model("medium")
    from quant_gemm import write_gptq_checkpoint

    int4 = write_gptq_checkpoint(medium, medium.parent / "medium-gptq4")
    f32 = write_gguf_f32(medium, GGUF_DIR / "medium-f32.gguf")
    commands: dict[str, Any] = {}
    ggufs: dict[str, Path] = {}
    for qtype in ("F16", "BF16"):
        ggufs[qtype.lower()], commands[f"quantize {qtype}"] = quantize(f32, qtype, args.threads)
    version = llamacpp_version()
    print(f"llama.cpp {version}")

    bench: dict[str, dict[str, Any]] = {}
    ae: dict[str, dict[str, Any]] = {}

    def run_llamacpp(name: str) -> None:
        bench[name] = batched_bench(ggufs[name], args.threads, args.steps, args.repeats, args.quiet_wait)
        bench[name]["gguf"] = gguf_facts(ggufs[name])
        print(f"llama.cpp {name}: {speeds(bench[name]['tok_s'])}; {load_line()}", flush=True)

    def run_ours(name: str, path: Path, q: str | None) -> None:
        ae[name] = asyncengine_run(path, q, args.steps, args.repeats, args.quiet_wait)
        print(f"asyncengine {name}: {speeds(ae[name]['tok_s'])}; {load_line()}", flush=True)

    # interleaved, so a change in the machine's load moves both sides of a pair alike
    for name in ("f16", "bf16"):
        run_llamacpp(name)
    # the float type llama.cpp runs faster here (geometric mean over the batches)
    fp = max(("f16", "bf16"), key=lambda k: math.prod(bench[k]["tok_s"].values()))
    run_ours("bf16", medium, None)
    for qtype, ours, path, q in (("Q8_0", "int8", medium, "int8"), ("Q4_0", "int4", int4, None)):
        key = qtype.lower()
        ggufs[key], commands[f"quantize {qtype}"] = quantize(f32, qtype, args.threads, fp.upper())
        ggufs[f"{key} default"], commands[f"quantize {qtype} default"] = quantize(f32, qtype, args.threads)
        run_llamacpp(key)
        run_ours(ours, path, q)
    for key in ("q8_0 default", "q4_0 default"):
        run_llamacpp(key)

    pairs = [("bf16", fp), ("int8", "q8_0"), ("int4", "q4_0")]
    rows = []
    for a, c in pairs:
        for b in BATCHES:
            ours, theirs = ae[a]["tok_s"][b], bench[c]["tok_s"][b]
            rows.append(
                [
                    f"{a} vs {c.upper()}",
                    b,
                    ours,
                    theirs,
                    ours / theirs,
                    ae[a]["linear_bytes"] / 2**20,
                    bench[c]["gguf"]["linear_bytes"] / 2**20,
                    bench[c]["gguf"]["file_bytes"] / 2**20,
                ]
            )
    headers = ["pair", "batch", "asyncengine tok/s", "llama.cpp tok/s", "ratio", "ae MiB", "lcpp MiB"]
    headers.append("GGUF MiB")
    print(f"\nDecode tokens/s, medium, {args.threads} threads, {PROMPT}-token prompts, {args.steps} steps:")
    print(table(headers, rows))
    lrows = [
        [
            name + (" (-nr)" if r.get("no_repack") else ""),  # run without weight repacking (see above)
            r["gguf"]["types"].get("linear"),
            r["gguf"]["types"].get("output"),
            *(r["tok_s"][b] for b in BATCHES),
            r["gguf"]["file_bytes"] / 2**20,
        ]
        for name, r in bench.items()
    ]
    print("\nllama.cpp, every GGUF (linear / LM head types):")
    print(table(["gguf", "linear", "LM head", *(f"batch {b} tok/s" for b in BATCHES), "file MiB"], lrows))

    check = None if args.skip_check else same_network(medium, {"f32": f32, **ggufs}, args.threads)
    commands["batched-bench"] = {k: v["commands"] for k, v in bench.items()}
    write_json(
        OUT / "llamacpp_compare.json",
        {
            "machine": info,
            "load_line": load_line(info),
            "load_end": load_line(),
            "threads": args.threads,
            "steps": args.steps,
            "repeats": args.repeats,
            "quiet_wait_s": args.quiet_wait,
            "llamacpp": version,
            "float_format": fp,
            "commands": commands,
            "asyncengine": ae,
            "llamacpp_runs": bench,
            "table": {"headers": headers, "rows": rows},
            "check": check,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
