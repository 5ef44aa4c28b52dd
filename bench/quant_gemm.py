#!/usr/bin/env python
"""Weight-only quantization on CPU, side by side in one run:

1. GEMMs: the fused int8 / int4 kernel (cpu/quant_gemm.py, bfloat16 activations) against the engine's
   bfloat16 GEMM (cpu/gemm.py: AMX tiles or oneDNN) and against dequantize-then-matmul (the PyTorch
   fallback), at M = 1, 16, 64, 256 for the medium model's layer shapes and a 7B-sized one;
2. decode tokens/s of the bench's medium Llama (~100M, hidden 768, 12 layers) at batch 1, 16 and 64 as
   bfloat16, `--quantization int8` and a GPTQ int4 checkpoint (group 128, written here), each also with
   `--lm-head-quantization int8` ("+head": this model's 32000 x 768 head is 23% of its bfloat16 weight
   bytes and over half of int4's), and int4 with `--lm-head-quantization int4` ("+head4"), and the bf16
   checkpoint quantized at load by `--quantization int4 --lm-head-quantization int4` ("rtn4+head4":
   round-to-nearest, group 32, float zero points), each driven
   through a ModelRunner (bench/gpu_check.py's loop on the CPU backend), with the resident bytes of the
   linear layers' weights and of the head per format.

    python bench/quant_gemm.py                 # both parts, 1 thread
    python bench/quant_gemm.py --skip-decode --threads 2
    python bench/quant_gemm.py --skip-gemm --threads 2   # the decode rows only (best of 3 interleaved runs)
    python bench/quant_gemm.py --float32 --threads 2     # only: float32 weights, the kernel against oneDNN

--float32: the kernel's plain float32 weights (quant_gemm.pack_f32, what cpu/gemm.py runs a float32 layer
on where the kernel has AVX-512) against oneDNN on its own blocked copy of the same weight (what it ran
before), the medium model's five shapes (the LM head included) at M = 1 to 2048, each weight cycled over
enough copies (~200 MB) that it streams from memory as in a decode step; GF/s and the kernel's speed-up.
Writes bench/out/quant_gemm.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, build_model, load_line, machine_info, table, write_json  # noqa: E402

import asyncengine  # noqa: E402, F401  (the installed package first)
from asyncengine.cpu import gemm as cpu_gemm  # noqa: E402
from asyncengine.cpu import quant_gemm  # noqa: E402
from asyncengine.quantization.canonical import QTYPE_U4, QTYPE_U8, Canonical, build  # noqa: E402
from asyncengine.quantization.packing import pack_int32  # noqa: E402

SHAPES = [  # (name, N, K)
    ("qkv 768->2304", 2304, 768),
    ("gate_up 768->4096", 4096, 768),
    ("down 2048->768", 768, 2048),
    ("7B o_proj 4096->4096", 4096, 4096),
]
ROWS = (1, 16, 64, 256)
GROUP = 128


def time_ms(fn: Callable[[], object], sync: Callable[[], None] = lambda: None, seconds: float = 0.3) -> float:
    """The fastest of repeats filling about `seconds` (after a warm-up call), in milliseconds: on a shared
    machine the minimum is the estimate least disturbed by other work (the median picks up time slices)."""
    fn()
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def canonical_weight(w: torch.Tensor, bits: int) -> Canonical:
    """Symmetric round-to-nearest codes of w [N, K]: int8 per channel, int4 per group of 128."""
    n, k = w.shape
    if bits == 8:
        scale = w.abs().amax(1) / 127
        q = (torch.round(w / scale[:, None]).clamp(-127, 127) + 128).to(torch.uint8)
        return build(q, torch.zeros(k, dtype=torch.int64), scale[None], torch.full((1, n), 128.0), QTYPE_U8)
    groups = torch.arange(k) // GROUP
    g = w.view(n, -1, GROUP)
    scale = (2 * g.abs().amax(2) / 15).clamp(min=1e-8)  # [N, G]
    q = (torch.round(g / scale[..., None]) + 8).clamp(0, 15).to(torch.uint8).view(n, k)
    return build(q, groups, scale.t().contiguous(), torch.full((k // GROUP, n), 8.0), QTYPE_U4)


def gemm_rows(threads: int) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        plain = w.bfloat16()
        bf16 = cpu_gemm.prepack(plain)  # what the engine runs for a bfloat16 layer (None: F.linear)
        packed = {}
        for bits in (8, 4):
            c = canonical_weight(w, bits)
            packed[bits] = quant_gemm.pack(c.q, c.scales, c.zeros, c.perm, k, c.group_size, c.qtype)
        fallback = canonical_weight(w, 4)
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            run_bf16 = (
                partial(cpu_gemm.linear, x, bf16, None) if bf16 is not None else partial(F.linear, x, plain)
            )
            t_bf16 = time_ms(run_bf16)
            t8 = time_ms(partial(quant_gemm.linear, x, packed[8], None))
            t4 = time_ms(partial(quant_gemm.linear, x, packed[4], None))
            t_deq = time_ms(partial(dequantize_then_matmul, x, fallback))
            rows.append([name, m, t_bf16, t8, t4, t_deq, t_bf16 / t8, t_bf16 / t4, t_bf16 / t_deq])
            print(table_row(rows[-1]), flush=True)
    return rows


F32_SHAPES = [  # (name, N, K): the medium model's linears
    ("qkv 768->2304", 2304, 768),
    ("o 768->768", 768, 768),
    ("gate_up 768->4096", 4096, 768),
    ("down 2048->768", 768, 2048),
    ("lm_head 768->32000", 32000, 768),
]
F32_ROWS = (1, 8, 64, 128, 512, 2048)


def _each(fn: Callable[..., object], weights: list[object], *args: object) -> None:
    for w in weights:
        fn(w, *args)


def float32_rows() -> list[list[object]]:
    """GF/s of oneDNN and of the kernel's float32 tiles per shape and M, timed alternately."""
    if not (cpu_gemm.enabled() and quant_gemm.native_f32()):
        print("float32: needs oneDNN and the kernel's AVX-512 build")
        return []
    rows: list[list[object]] = []
    for name, n, k in F32_SHAPES:
        copies = max(1, int(200e6 // (n * k * 4)))  # cycled, so each call reads its weight from memory
        weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, cpu_gemm.BATCH_HINT) for w in weights]
        ours = [quant_gemm.pack_f32(w) for w in weights]
        for m in F32_ROWS:
            x = torch.randn(m, k)
            linear_pointwise = partial(torch.ops.mkldnn._linear_pointwise, x)
            run_onednn = partial(_each, linear_pointwise, onednn, None, "none", [], "")
            run_ours = partial(_each, partial(quant_gemm.linear, x), ours, None)
            t_a = t_b = float("inf")
            for _ in range(3):  # alternated: the machine's other load hits both alike
                t_a, t_b = min(t_a, time_ms(run_onednn)), min(t_b, time_ms(run_ours))
            flops = 2 * m * n * k * copies / 1e6  # per ms -> GF/s
            rows.append([name, m, flops / t_a, flops / t_b, t_a / t_b])
            print(table_row(rows[-1]), flush=True)
    return rows


def dequantize_then_matmul(x: torch.Tensor, weight: Canonical) -> torch.Tensor:
    """The PyTorch fallback: the whole weight dequantized (float32, then bfloat16) for one F.linear."""
    return F.linear(weight.gather_input(x), weight.dequantize().bfloat16())


def table_row(row: list[object]) -> str:
    name, m, *vals = row
    return f"{name:<22} M={m:<4} " + " ".join(f"{v:8.3f}" for v in vals)  # type: ignore[union-attr]


def write_gptq_checkpoint(src: Path, dst: Path) -> Path:
    """`src` (a float Llama) as a GPTQ v1 checkpoint: 4 bits, group 128, symmetric, round to nearest."""
    from safetensors.torch import load_file, save_file

    if (dst / "model.safetensors").exists():
        return dst
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if ".layers." in name and name.endswith("_proj.weight"):
            c = canonical_weight(t.float(), 4)
            prefix = name.removesuffix(".weight")
            out[f"{prefix}.qweight"] = pack_int32(c.q[:, : t.shape[1]].t(), 4, dim=0)
            out[f"{prefix}.qzeros"] = pack_int32(torch.full_like(c.scales, 7, dtype=torch.int32), 4, dim=1)
            out[f"{prefix}.scales"] = c.scales.half()
            out[f"{prefix}.g_idx"] = (torch.arange(t.shape[1]) // GROUP).to(torch.int32)
        else:
            out[name] = t
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def weight_bytes(model_dir: Path, quantization: str | None, lm_head: str | None) -> tuple[int, int]:
    """Resident bytes of the decoder layers' linear weights and of the LM head after loading (bfloat16
    for plain ones; scales, zero points and padding included)."""
    from asyncengine.layers.embedding import ParallelLMHead
    from asyncengine.layers.parallel import ParallelContext
    from asyncengine.models.loader import load_model
    from asyncengine.quantization.kernels import resident_bytes

    model = load_model(
        str(model_dir),
        ParallelContext(),
        torch.bfloat16,
        torch.device("cpu"),
        quantization=quantization,
        lm_head_quantization=lm_head,
    )
    layers = head = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            head = resident_bytes(module.quant_weight) if module.quant_weight is not None else 0
            head += module.weight.numel() * module.weight.element_size()
        elif getattr(module, "quant_weight", None) is not None:
            layers += resident_bytes(module.quant_weight)
        elif hasattr(module, "quant_method") and module.weight.numel():
            layers += module.weight.numel() * module.weight.element_size()
    return layers, head


def linear_weight_bytes(model_dir: Path, quantization: str | None) -> int:
    """The decoder layers' linear weight bytes (bench/llamacpp_compare.py's column)."""
    return weight_bytes(model_dir, quantization, None)[0]


def decode_rows(steps: int, repeats: int) -> list[list[object]]:
    """Decode tokens/s per format at batch 1 and 16, then the weight MiB rows; ratios over bf16. Each figure
    is the best of `repeats` runs, the formats interleaved within each repeat, so that load drift on a
    shared machine moves every format alike (single runs of bf16 ranged 115-158 tok/s on this VM)."""
    from gpu_check import decode_throughput

    medium = build_model("medium")
    int4 = write_gptq_checkpoint(medium, medium.parent / "medium-gptq4")
    formats = {  # name: (checkpoint, --quantization, --lm-head-quantization)
        "bf16": (medium, None, None),
        "int8": (medium, "int8", None),
        "int4": (int4, None, None),
        "int8+head": (medium, "int8", "int8"),
        "int4+head": (int4, None, "int8"),
        "int4+head4": (int4, None, "int4"),
        "rtn4+head4": (medium, "int4", "int4"),
    }
    sizes = {name: weight_bytes(*spec) for name, spec in formats.items()}
    rows: list[list[object]] = []
    for batch in (1, 16, 64):  # 64: past quant_gemm.AMX_MIN_ROWS, the AMX path on a CPU with AMX
        tok_s = dict.fromkeys(formats, 0.0)
        for _ in range(repeats):
            for name, (path, q, h) in formats.items():
                tps = decode_throughput(
                    path, batch, False, steps, device="cpu", quantization=q, lm_head_quantization=h
                )
                tok_s[name] = max(tok_s[name], tps)
        rows.append([batch, *tok_s.values(), *(tok_s[f] / tok_s["bf16"] for f in FORMATS_X)])
        print(rows[-1], flush=True)
    for i, what in enumerate(("layers MiB", "head MiB")):
        mib = {f: sizes[f][i] / 2**20 for f in formats}
        rows.append([what, *mib.values(), *(mib[f] / mib["bf16"] for f in FORMATS_X)])
    return rows


FORMATS_X = ("int8", "int4", "int8+head", "int4+head", "int4+head4", "rtn4+head4")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="decode: best of this many interleaved runs")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--float32", action="store_true", help="only the float32 kernel against oneDNN")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not quant_gemm.available():
        print("the quantized CPU kernel could not be built (no C compiler?)")
        return 1
    print(load_line(machine_info()))
    if args.float32:
        f32 = float32_rows()
        print(f"\nfloat32 GEMM, GF/s ({args.threads} threads): oneDNN, the kernel's float32 tiles, speed-up:")
        print(table(["layer", "M", "oneDNN", "kernel", "kernel x"], f32, digits=2))
        info = {"machine": machine_info(), "threads": args.threads, "rows": f32}
        write_json(OUT / "quant_gemm_f32.json", info)
        return 0
    gemm = [] if args.skip_gemm else gemm_rows(args.threads)
    if gemm:
        print("\nGEMM, ms per call (bfloat16 activations) and speed-up over bf16:")
        print(
            table(
                [
                    "layer",
                    "M",
                    "bf16",
                    "int8 fused",
                    "int4 fused",
                    "int4 deq+mm",
                    "int8 x",
                    "int4 x",
                    "deq+mm x",
                ],
                gemm,
                digits=3,
            )
        )
    decode = [] if args.skip_decode else decode_rows(args.steps, args.repeats)
    if decode:
        print("\nDecode, medium model (tokens/s), and the linear layers' resident weight bytes:")
        headers = ["batch", "bf16", *FORMATS_X, *(f"{f} x" for f in FORMATS_X)]
        print(table(headers, decode, digits=2))
    write_json(
        OUT / "quant_gemm.json",
        {"machine": machine_info(), "threads": args.threads, "gemm": gemm, "decode": decode},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
