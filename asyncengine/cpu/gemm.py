"""The linear layers' GEMMs on CPU, with each weight reordered once: bfloat16 into AMX tiles where the CPU
has AMX (cpu/amx.py, faster at a decode step's M), bfloat16 into the quantized kernel's 16-row blocks
where the CPU has AVX512-BF16 but no AMX (cpu/quant_gemm.py's QT_BF16: measured on an AMD EPYC with 2
threads, 1.1-1.7x oneDNN at M = 1-16 and 0.95-1.08x from M = 64 to 1024 on the bench's medium layers and
a 7B-sized one, and every linear a C kernel lets decode steps replay as kernel graphs), float32 into the
same kernel's float32 blocks where the CPU has AVX-512 (QT_F32: 1.1-1.35x oneDNN at M = 8-64, 1.0-1.06x
at prefill sizes, same machine), otherwise (bfloat16 or float32 elsewhere) into oneDNN's blocked
layout.

`F.linear` hands MKL / oneDNN a plain row-major weight, and for the small-M GEMMs of a decode step
(M = the batch) the library re-packs the whole weight on every call: profiled at ~12% of a float32
decode step (mkl `sgemm_scopy_right48`), i.e. one extra pass over every weight per step. Reordering at
load time removes it. Measured on this machine's 2 cores (K=768, N=4096): float32 M=7..64 20-50%
faster, M=2048 equal, M=1 ~15% slower; bfloat16 (AMX through oneDNN) 30-40% faster at M <= 64.

The oneDNN tensor is opaque (layout `torch._mkldnn`), the AMX one a flat bfloat16 tensor; a layer that
packs its weight keeps only the packed copy, so a CPU model holds its weights once.

For oneDNN, rows are padded up to a bucket (`bucket_rows`; the AMX kernel takes any M as it is).
oneDNN JIT-compiles and caches one primitive per (weight shape, M), ~1 ms to build and 0.3-5 MiB to
keep (more for larger M), and a serving worker sees every M from 1 to the token budget: measured, 256
distinct M on the five GEMM shapes of a 100M model grew a process by 3.6 GiB (bfloat16) and 6.3 GiB
(float32), and the growth went on past oneDNN's cache capacity. With 58 buckets up to M = 2048 the
cache stays bounded. Padding is cheap where it happens most: small-M GEMMs stream the weight and cost
about the same for 1..16 rows.
"""

from __future__ import annotations

import os
from functools import cache

import torch
from torch import nn

from asyncengine.cpu import amx, quant_gemm
from asyncengine.cpu.amx import AmxWeight
from asyncengine.cpu.quant_gemm import QuantWeight

# a packed weight: AMX tiles (bfloat16 on an AMX CPU), the quantized kernel's bfloat16 blocks (bfloat16 on
# an AVX512-BF16 CPU without AMX) or an opaque oneDNN tensor
PackedWeight = AmxWeight | QuantWeight | torch.Tensor

# The M the blocked layout is chosen for. Any M works with it; 64..2048 measured alike, 1 was worse.
BATCH_HINT = 128
# float32 weights smaller than this stay plain (F.linear, MKL): a packed call costs ~12 us more in fixed
# overhead, which small weights never earn back. Measured on 2 threads: 768x256 (0.75 MiB) at M = 1-4
# 20-22 us packed against 8-9 plain, at M = 16-2048 alike; 1376x256 (1.34 MiB) is already 30% faster
# packed at M = 16. bfloat16 weights are always packed: oneDNN's AMX path beats F.linear at every size.
FP32_PACK_MIN_BYTES = 1 << 20


def packing_on() -> bool:
    """ASYNCENGINE_CPU_PREPACK=0 turns every packing off (A/B): layers keep their weights and F.linear."""
    return os.environ.get("ASYNCENGINE_CPU_PREPACK", "1") != "0"


def enabled() -> bool:
    """oneDNN packing is used when torch was built with it and packing is on."""
    return (
        packing_on()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def prepack(weight: torch.Tensor) -> PackedWeight | None:
    """[out, in] weight -> its packed copy (AMX tiles for bfloat16 where the CPU has AMX, the quantized
    kernel's blocks for bfloat16 on AVX512-BF16 and float32 on AVX-512, else oneDNN's layout), or None
    where packing does not apply. One copy either way: at the M of a prefill chunk oneDNN
    is 10-20% faster than the AMX kernel, but keeping both would double the weights' memory for 1-3% of
    offline throughput (bench/RESULTS.md)."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or weight.dim() != 2
    ):
        return None
    if not weight.numel() or not packing_on():
        return None
    with torch.no_grad():
        tiles = amx.pack(weight)  # None unless bfloat16 on an AMX CPU
        if tiles is not None:
            return tiles
        if weight.dtype == torch.bfloat16 and quant_gemm.native_bf16():
            packed = quant_gemm.pack_bf16(weight)
            if packed is not None:
                return packed
        if weight.dtype == torch.float32:
            # every size: from 256 x 768 level with F.linear at M = 1 and 2-3x at M = 4-64 (2 threads, AMD
            # Zen 5); a tiny one pays the call's ~6 us against F.linear's 2, and in exchange every linear is
            # a kernel call (kernel graphs) and a row's bits do not depend on the batch around it
            packed = quant_gemm.pack_f32(weight)
            if packed is not None:
                return packed
    if not enabled():
        return None
    if weight.dtype == torch.float32 and weight.numel() * weight.element_size() < FP32_PACK_MIN_BYTES:
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


def prepack_gated(weight: torch.Tensor) -> AmxWeight | QuantWeight | None:
    """A merged [gate | up] weight packed for its GEMM to return silu(gate) * up: bfloat16 on AMX tiles
    (amx.pack(gated=True)) or, on an AVX512-BF16 CPU without AMX, the bfloat16 kernel's blocks
    (quant_gemm.pack_bf16(gated=True)); float32 the float32 kernel's blocks (quant_gemm.pack_f32(gated=
    True)); None where none applies (another dtype, packing off, an intermediate size not of 16)."""
    if not weight.numel() or not packing_on() or weight.dim() != 2:
        return None
    with torch.no_grad():
        if weight.dtype == torch.float32:
            return quant_gemm.pack_f32(weight, gated=True)
        tiles = amx.pack(weight, gated=True)
        if tiles is not None or weight.dtype != torch.bfloat16:
            return tiles
        return quant_gemm.pack_bf16(weight, gated=True) if quant_gemm.native_bf16() else None


@cache
def bucket_rows(rows: int) -> int:
    """The M a GEMM of `rows` rows runs at: 1, 2, 4, 8, then steps of 4 up to 64 and eight buckets per
    octave beyond (steps of 1/16 of the next power of two): at most 1/8 extra rows past 32. Finer steps
    would add primitives; coarser ones cost float32, whose GEMMs are compute-bound from M ~ 16."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    step = max(4, (1 << (rows - 1).bit_length()) // 16)
    return -(-rows // step) * step


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """[T, in] -> [T, out]: x W^T + b with a weight from `prepack` (oneDNN: at a bucketed row count)."""
    if isinstance(packed, AmxWeight):
        return amx.linear(x, packed, bias)  # any M: no primitives to cache
    if isinstance(packed, QuantWeight):
        return quant_gemm.linear(x, packed, bias)
    rows = x.shape[0]
    padded = bucket_rows(rows) if x.dim() == 2 else rows
    if padded != rows:
        # zeros, not garbage: rows are independent, but denormal garbage would slow the FMAs down
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:rows] if padded != rows else out


def prepack_model(model: nn.Module) -> int:
    """Packs every layer that knows how (a `prepack()` method); returns how many did."""
    return sum(bool(m.prepack()) for m in model.modules() if callable(getattr(m, "prepack", None)))
