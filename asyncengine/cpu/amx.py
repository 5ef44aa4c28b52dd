"""bfloat16 linear layers on Intel AMX through csrc/amx_gemm.c, with the weight packed once into AMX tiles.

oneDNN (cpu/gemm.py) reads the weights of a decode step's GEMMs at ~19-22 GB/s on this machine and
does not overlap its AMX arithmetic with those reads; the kernel here streams them at 26-32 GB/s with
software prefetch. Measured on the bench's medium model (all 12 layers' projections and the LM head,
219 MB, cold, 2 threads): M = 1 1.35x, M = 32 1.28x, M = 64 1.1-1.2x oneDNN's speed, M = 128 alike;
`bench/cpu_kernels.py` prints the comparison. At prefill sizes oneDNN stays ahead (the layers' GEMMs at
M = 2048: 154 against 125-137 ms), but only one packed copy of a weight is kept (gemm.prepack says why).

A merged [gate | up] weight can be packed `gated`: the GEMM then returns silu(gate) * up (LlamaMLP.prepack),
one op less and half the output written; the result is ops.silu_and_mul's on the plain output, bit for bit.

A row's output does not depend on the rest of the batch (each output element is accumulated over K in one
fixed order), unlike oneDNN's, whose kernels change with M.

Used where the CPU has AMX-BF16 and Linux grants the tile state; ASYNCENGINE_CPU_AMX=0 turns it off (A/B).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from asyncengine.cpu.build import build_library

SOURCE = Path(__file__).parent / "csrc" / "amx_gemm.c"
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
K_ALIGN = 32  # the kernel's K step (one tile row holds 32 bfloat16); other K are zero-padded


class AmxWeight(NamedTuple):
    """A [out, in] bfloat16 weight in AMX tile layout (csrc/amx_gemm.c), zero-padded to in_padded."""

    data: torch.Tensor  # [ceil(out/16) * in_padded/32 * 512] bfloat16
    out_features: int
    in_features: int
    in_padded: int  # in_features rounded up to K_ALIGN
    gated: bool = False  # a [gate | up] weight packed for `linear` to return silu(gate) * up, [T, out / 2]

    def numel(self) -> int:
        return self.data.numel()


def allowed() -> bool:
    """ASYNCENGINE_CPU_AMX=0 keeps every AMX kernel off (these GEMMs and csrc/amx_attention.c)."""
    return os.environ.get("ASYNCENGINE_CPU_AMX", "1") != "0"


@cache
def load_library() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot run: no compiler, no AMX-BF16, tiles not granted."""
    if not allowed():
        return None
    lib = build_library(SOURCE)
    if lib is None:
        return None
    lib.amx_available.restype = _I
    lib.amx_available.argtypes = []
    lib.amx_packed_size.restype = ctypes.c_size_t
    lib.amx_packed_size.argtypes = [_I, _I]
    for name in ("amx_pack_bf16", "amx_pack_bf16_gated"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [_P, _P, _I, _I]
    lib.amx_linear_bf16.restype = _I
    lib.amx_linear_bf16.argtypes = [_P, _L, _P, _P, _P, _L, _I, _I, _I, _I, _I]
    lib.amx_linear_quant.restype = _I
    lib.amx_linear_quant.argtypes = [_P, _L, _I, _P, _P, _P, _P, _I, _I, _I, _P, _P, _L, _I, _I, _I]
    return lib if lib.amx_available() else None


def available() -> bool:
    return load_library() is not None


def pack(weight: torch.Tensor, gated: bool = False) -> AmxWeight | None:
    """[out, in] bfloat16 CPU weight -> its tile-packed copy; None where AMX does not apply.
    gated: a merged [gate | up] weight (out a multiple of 32), packed so that `linear` returns
    silu(gate) * up, as ops.silu_and_mul would on the plain output, bit for bit."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    lib = load_library()  # only for bfloat16: a float32 worker never builds it nor asks for AMX state
    if lib is None:
        return None
    n, k = weight.shape
    if not n or not k or n >= 2**31 or k >= 2**31 or (gated and n % 32):
        return None
    kp = -(-k // K_ALIGN) * K_ALIGN
    w = F.pad(weight.detach(), (0, kp - k)) if kp != k else weight.detach().contiguous()
    data = torch.empty(lib.amx_packed_size(n, kp), dtype=torch.bfloat16)
    (lib.amx_pack_bf16_gated if gated else lib.amx_pack_bf16)(w.data_ptr(), data.data_ptr(), n, kp)
    return AmxWeight(data, n, k, kp, gated)


def linear(x: torch.Tensor, weight: AmxWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """[T, in] bfloat16 -> [T, out]: x W^T + b, rounded to bfloat16 once; a gated weight gives
    [T, out / 2] = silu(gate) * up of that output."""
    lib = load_library()
    assert lib is not None, "an AmxWeight exists only where the library loaded"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if weight.in_padded != weight.in_features:
        x2 = F.pad(
            x2, (0, weight.in_padded - weight.in_features)
        )  # zeros: the padded weight columns are 0 too
    elif x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.dtype != torch.bfloat16:
        raise TypeError(f"AMX linear takes bfloat16 activations, got {x2.dtype}")
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    rows = x2.shape[0]
    width = weight.out_features // 2 if weight.gated else weight.out_features
    out = torch.empty(rows, width, dtype=torch.bfloat16)
    rc = lib.amx_linear_bf16(
        x2.data_ptr(),
        x2.stride(0),
        weight.data.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        out.stride(0),
        rows,
        weight.out_features,
        weight.in_padded,
        torch.get_num_threads(),
        int(weight.gated),
    )
    if rc == -2:
        raise MemoryError("AMX linear could not allocate its scratch rows")
    assert rc == 0, f"amx_linear_bf16 returned {rc}"
    return out.reshape(*lead, width)


def linear_quant(
    x: torch.Tensor,  # [T, in] bfloat16, unit stride along in
    perm: torch.Tensor | None,  # [k_int] int64: the input column of each code column, -1 reads zero
    data: torch.Tensor,  # csrc/quant_gemm.c's layout: [blocks, k_int / 8 or k_int / 4, 16, 4] uint8
    scales: torch.Tensor,  # [blocks, G, 16] float32
    zeros: torch.Tensor | None,  # [blocks, G, 16] float32
    qtype: int,  # 0: 4-bit codes, 1: 8-bit
    k_int: int,  # a multiple of 32
    group_size: int,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """[T, out] bfloat16 = x W^T + b for 4- / 8-bit codes: each 2-block group's codes dequantized once per
    row block into bfloat16 tiles, w = bf16((code - zero) * scale), then multiplied on AMX (csrc/amx_gemm.c);
    the activations are gathered into the codes' column order there (act-order, groups padded to whole
    steps), so that a kernel graph replays one call. For prefill-sized T, where quant_gemm.c's VNNI kernel
    is bound by its arithmetic."""
    lib = load_library()
    assert lib is not None, "called only where the AMX library loaded"
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    rc = lib.amx_linear_quant(
        x.data_ptr(),
        x.stride(0),
        x.shape[1],
        perm.data_ptr() if perm is not None else None,
        data.data_ptr(),
        scales.data_ptr(),
        zeros.data_ptr() if zeros is not None else None,
        qtype,
        k_int,
        group_size,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        out.stride(0),
        x.shape[0],
        out_features,
        torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError("AMX quantized linear could not allocate its scratch tiles")
    assert rc == 0, f"amx_linear_quant returned {rc}"
    return out
