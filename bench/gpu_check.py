"""One GPU check, under 5 minutes on one GPU, installing nothing:

1. runs the GPU tests (CUDA-graph capture/replay vs eager, Triton kernels vs the reference, NCCL P=2
   when two GPUs exist);
2. prints decode tokens/s at batch 1, 8 and 64, with and without CUDA graphs, for a ~100M-parameter
   random Llama;
3. prints Triton vs PyTorch-reference attention time for a decode batch;
4. prints the Triton W4A16 / W8A16 / FP8-weight GEMM against the bfloat16 matmul at M = 1-256, and
   decode tokens/s of the same Llama as bfloat16, --quantization int8 and a GPTQ int4 checkpoint
   (bench/quant_gemm.py measures the CPU side).

Usage: python bench/gpu_check.py [--skip-tests] [--steps 50]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from asyncengine.quantization.canonical import Canonical

sys.path.insert(0, str(Path(__file__).resolve().parent))  # quant_gemm.py, beside this script


def run_gpu_tests() -> int:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "tests/cuda",
        "tests/asyncengine/layers",
        "tests/asyncengine/cpu",
        "tests/asyncengine/test_gpu_engine.py",
        "-p",
        "no:cacheprovider",
    ]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, timeout=240).returncode


def build_model(path: Path) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def decode_throughput(
    model_dir: Path,
    batch: int,
    eager: bool,
    steps: int,
    device: str = "cuda",
    quantization: str | None = None,
    lm_head_quantization: str | None = None,
) -> float:
    """Decode tokens/s of a ModelRunner driven directly (no engine): a 128-token prefill, then `steps`
    greedy decode steps. device="cpu" runs the same code with the CPU backend (the tests do, so this
    script cannot rot on machines without a GPU). bench/quant_gemm.py runs it for quantized models."""
    from asyncengine.config import EngineConfig
    from asyncengine.layers.attention import set_attention_backend
    from asyncengine.layers.attention_cpu import CpuAttentionBackend
    from asyncengine.layers.attention_triton import TritonAttentionBackend
    from asyncengine.layers.parallel import ParallelContext
    from asyncengine.transport.wire import SamplingOptions
    from asyncengine.worker.input_batch import SeqState, StepBatch
    from asyncengine.worker.model_runner import ModelRunner

    dev = torch.device(device)
    set_attention_backend(TritonAttentionBackend() if dev.type == "cuda" else CpuAttentionBackend())
    cfg = EngineConfig(
        model=str(model_dir),
        dtype="bfloat16",
        max_num_seqs=64,
        enforce_eager=eager,
        quantization=quantization,
        lm_head_quantization=lm_head_quantization,
    )
    runner = ModelRunner(cfg, ParallelContext(), dev, torch.bfloat16, 1024)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    blocks_per_seq = 1024 // cfg.block_size
    runner.init_cache(batch * blocks_per_seq)
    runner.capture_graphs()
    rng = random.Random(0)
    seqs = []
    for i in range(batch):
        prompt = [rng.randrange(runner.model.config.vocab_size) for _ in range(128)]
        seqs.append(
            SeqState(
                i,
                prompt,
                len(prompt),
                list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                0,
                SamplingOptions(temperature=0.0),
            )
        )
    first = runner.execute_model(
        runner.prepare_model_input(StepBatch(0, seqs, [128] * batch, [0] * batch)), None
    )
    for s, t in zip(seqs, first.token_ids):  # the prefill's sampled token is the first decode input
        s.num_computed_tokens = 128
        s.token_ids.append(t)

    def decode_step(step: int) -> None:
        out = runner.execute_model(
            runner.prepare_model_input(StepBatch(step, seqs, [1] * batch, [0] * batch)), None
        )
        for s, t in zip(seqs, out.token_ids):
            s.num_computed_tokens += 1
            s.token_ids.append(t)

    # one untimed step: on a CPU the first decode step at a batch size captures its kernel graph (~20-40 ms
    # of Python, 10-20% of a 32-step run at batch 1), as CUDA graphs are captured before this loop
    decode_step(1)
    sync()
    start = time.perf_counter()
    for step in range(steps):
        decode_step(step + 2)
    sync()
    elapsed = time.perf_counter() - start
    runner.close()
    return batch * steps / elapsed


def attention_times() -> tuple[float, float]:
    sys.path.insert(0, "tests/asyncengine/cpu")
    from test_attention_cpu import build_batch

    from asyncengine.layers.attention_torch import TorchAttentionBackend
    from asyncengine.layers.attention_triton import TritonAttentionBackend

    rng = random.Random(0)
    q, k, v, kc, vc, meta = build_batch(
        [1] * 64, [rng.randint(64, 1024) for _ in range(64)], 32, 8, 128, 16, torch.bfloat16
    )
    dev = torch.device("cuda")
    q, k, v, kc, vc = (t.to(dev) for t in (q, k, v, kc, vc))
    meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables = (
        t.to(dev) for t in (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    )
    result = []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        for _ in range(3):
            backend.forward(q, k, v, kc, vc, meta, 0.088)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            backend.forward(q, k, v, kc, vc, meta, 0.088)
        torch.cuda.synchronize()
        result.append((time.perf_counter() - t0) / 20 * 1e3)
    return result[0], result[1]


def fp8_canonical(w: torch.Tensor) -> Canonical:
    """e4m3 codes of w [N, K] with one scale per output channel (max |w| / 448), as "-FP8" checkpoints."""
    from asyncengine.quantization.canonical import QTYPE_FP8, build

    scale = (w.abs().amax(1) / 448).clamp(min=1e-12)  # [N]
    q = (w / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return build(q, torch.zeros(w.shape[1], dtype=torch.int64), scale[None], None, QTYPE_FP8)


def quant_gemm_times() -> list[tuple[int, int, int, float, float, float, float]]:
    """(N, K, M, bf16 ms, W8A16 ms, W4A16 ms, FP8 ms) of the Triton quantized GEMM against torch's bf16
    matmul."""
    from quant_gemm import canonical_weight, time_ms

    from asyncengine.cuda import triton_quant_gemm

    dev = torch.device("cuda")
    rows = []
    for n, k in ((4096, 4096), (11008, 4096), (4096, 11008)):
        w = torch.randn(n, k) * 0.02
        dense = w.to(dev, torch.bfloat16)
        packed = {}
        for fmt in ("w8", "w4", "fp8"):
            c = fp8_canonical(w) if fmt == "fp8" else canonical_weight(w, 8 if fmt == "w8" else 4)
            args = (c.q, c.scales, c.zeros, c.perm, c.in_features, c.group_size, c.qtype)
            packed[fmt] = triton_quant_gemm.pack(*args, dev)
        for m in (1, 16, 64, 256):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            times = [time_ms(partial(torch.matmul, x, dense.t()), torch.cuda.synchronize)]
            for fmt in ("w8", "w4", "fp8"):
                run = partial(triton_quant_gemm.linear, x, packed[fmt], None)
                times.append(time_ms(run, torch.cuda.synchronize))
            rows.append((n, k, m, *times))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rc = 0 if args.skip_tests else run_gpu_tests()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "llama100m")
        print(f"\n{'batch':>6} {'eager tok/s':>12} {'graphs tok/s':>13} {'speed-up':>9}")
        for batch in (1, 8, 64):
            eager = decode_throughput(model, batch, True, args.steps)
            graphs = decode_throughput(model, batch, False, args.steps)
            print(f"{batch:>6} {eager:>12.0f} {graphs:>13.0f} {graphs / eager:>8.2f}x", flush=True)
        quantized_decode(model, args.steps)
    triton_ms, torch_ms = attention_times()
    print(
        f"\ndecode attention, 64 seqs x 64-1024 tokens, 32 q / 8 kv heads, d=128, bf16: "
        f"triton {triton_ms:.3f} ms, torch reference {torch_ms:.3f} ms ({torch_ms / triton_ms:.1f}x)"
    )
    print(f"\n{'N':>6} {'K':>6} {'M':>4} {'bf16 ms':>8} {'W8 ms':>8} {'W4 ms':>8} {'FP8 ms':>8}", end="")
    print(f" {'W8 x':>6} {'W4 x':>6} {'FP8 x':>6}")
    for n, k, m, bf16, w8, w4, f8 in quant_gemm_times():
        print(f"{n:>6} {k:>6} {m:>4} {bf16:>8.3f} {w8:>8.3f} {w4:>8.3f} {f8:>8.3f}", end="")
        print(f" {bf16 / w8:>6.2f} {bf16 / w4:>6.2f} {bf16 / f8:>6.2f}")
    return rc


def quantized_decode(model: Path, steps: int) -> None:
    """Decode tokens/s of `model` as bfloat16, int8 (at load time) and GPTQ int4 (written here)."""
    from quant_gemm import write_gptq_checkpoint

    int4 = write_gptq_checkpoint(model, model.parent / "llama100m-gptq4")
    print(f"\n{'batch':>6} {'bf16 tok/s':>11} {'int8 tok/s':>11} {'int4 tok/s':>11}")
    for batch in (1, 16):
        bf16 = decode_throughput(model, batch, False, steps)
        int8 = decode_throughput(model, batch, False, steps, quantization="int8")
        gptq = decode_throughput(int4, batch, False, steps)
        print(f"{batch:>6} {bf16:>11.0f} {int8:>11.0f} {gptq:>11.0f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
