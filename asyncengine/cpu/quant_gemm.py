"""Weight-only quantized linear layers on CPU through csrc/quant_gemm.c: 4-bit / 8-bit codes or float8
e4m3 weights, dequantized in registers inside the GEMM (never a whole weight per call).

A decode step on a CPU is bound by reading the weights: 4-bit codes are a quarter of bfloat16's bytes.
`pack` takes the canonical layout (asyncengine/quantization/canonical.py: codes [N, K_int] with
contiguous groups, per-(group, row) scales and zero points, an optional input permutation) and
reorders it into the kernel's 16-row blocks once, at load time. bench/quant_gemm.py measures the
kernel against bfloat16 GEMMs and against dequantize-then-matmul.

With bfloat16 activations and 4- / 8-bit codes on a CPU with AVX512-VNNI the kernel quantizes the
activations to int8 (per row and 32 columns, as llama.cpp's Q8_0) and multiplies integers: single-stream
decode then reads the codes at the memory's rate instead of waiting on the arithmetic that widens them.
ASYNCENGINE_CPU_INT8_ACTIVATIONS=0 keeps the activations as they are (weights packed then use the exact
bfloat16 path). float32 activations are never quantized: they stay exact against the dequantized weight.

ASYNCENGINE_CPU_QUANT=0 keeps the library unloaded: callers use their PyTorch fallback (A/B).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from asyncengine.cpu import amx
from asyncengine.cpu.build import build_library

SOURCE = Path(__file__).parent / "csrc" / "quant_gemm.c"
QTYPE_U4, QTYPE_U8, QTYPE_FP8 = 0, 1, 2  # the kernel's code types (canonical.QTYPE_* are the same)
QTYPE_BF16 = 3  # plain bfloat16 weights (pack_bf16): no scales or zeros to apply
QTYPE_F32 = 4  # plain float32 weights (pack_f32), float32 activations only
BLOCK = 16  # output rows per block: one float32 vector
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long


class QuantWeight(NamedTuple):
    """A [out, in] weight in the kernel's layout (see csrc/quant_gemm.c)."""

    # [blocks, K_int / 8 (4-bit) or K_int / 4 (8-bit), 16, 4] uint8; e4m3: [blocks, K_int, 16];
    # bfloat16: [blocks, K_int / 2, 16, 2]; float32: [blocks, K, 16]
    data: torch.Tensor
    scales: torch.Tensor  # [blocks, G, 16] float32 (e4m3: scale * 256)
    zeros: torch.Tensor | None  # [blocks, G, 16] float32; None for e4m3
    perm: torch.Tensor | None  # [K_int] int64 input column per internal column, -1 reads zero
    qtype: int
    out_features: int
    in_features: int
    k_int: int
    group_size: int
    portable: bool = False  # built without AVX-512 (tests run both)
    int8_activations: bool = False  # bfloat16 activations quantized to int8 (4- / 8-bit codes, VNNI)
    gated: bool = False  # a [gate | up] weight whose `linear` returns silu(gate) * up, [T, out / 2]

    def nbytes(self) -> int:
        """Resident bytes of the packed weight."""
        parts = [self.data, self.scales, self.zeros, self.perm]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def allowed() -> bool:
    return os.environ.get("ASYNCENGINE_CPU_QUANT", "1") != "0"


def load_library(portable: bool = False) -> ctypes.CDLL | None:
    # one library object per build whatever the call's spelling (load_library() and load_library(False)
    # were two cache entries, two CDLL objects, each with its own function attributes)
    return _load_library(bool(portable))


@cache
def _load_library(portable: bool) -> ctypes.CDLL | None:
    if not allowed():
        return None
    lib = build_library(SOURCE, portable)
    if lib is None:
        return None
    lib.qgemm.restype = _I
    lib.qgemm.argtypes = [_P, _L, _I, _I, _P, _P, _P, _P, _P, _P, _L, _I, _I, _I, _I, _I, _I, _I]
    for gated in (lib.qgemm_bf16_gated, lib.qgemm_f32_gated):
        gated.restype = _I
        gated.argtypes = [_P, _L, _P, _P, _P, _L, _I, _I, _I, _I]
    for probe in (lib.qgemm_native_bf16, lib.qgemm_native_int8, lib.qgemm_native_f32):
        probe.restype = _I
        probe.argtypes = []
    return lib


def available(portable: bool = False) -> bool:
    return load_library(portable) is not None


def native_bf16() -> bool:
    """The kernel multiplies bfloat16 on vdpbf16ps here (AVX512-BF16): cpu/gemm.py then gives it the bfloat16
    linears of a CPU without AMX (pack_bf16). ASYNCENGINE_CPU_BF16_KERNEL=0 keeps them on oneDNN (A/B)."""
    if os.environ.get("ASYNCENGINE_CPU_BF16_KERNEL", "1") == "0":
        return False
    lib = load_library()
    return lib is not None and bool(lib.qgemm_native_bf16())


def native_f32() -> bool:
    """float32 weights run on this kernel's tiles here (AVX-512): cpu/gemm.py then gives it the float32
    linears (pack_f32): 1.1-1.35x oneDNN at M = 8-64, 1.0-1.06x from 128 on, level at 1 (both stream the
    weight); `python bench/quant_gemm.py --float32`.
    ASYNCENGINE_CPU_F32_KERNEL=0 keeps them on oneDNN (A/B)."""
    if os.environ.get("ASYNCENGINE_CPU_F32_KERNEL", "1") == "0":
        return False
    lib = load_library()
    return lib is not None and bool(lib.qgemm_native_f32())


def native_int8(portable: bool = False) -> bool:
    """bfloat16 activations are quantized to int8 for 4- / 8-bit codes here (AVX512-VNNI, and not turned
    off by ASYNCENGINE_CPU_INT8_ACTIVATIONS=0): decided per weight when it is packed."""
    if os.environ.get("ASYNCENGINE_CPU_INT8_ACTIVATIONS", "1") == "0":
        return False
    lib = load_library(portable)
    return lib is not None and bool(lib.qgemm_native_int8())


def _whole_steps(
    q: torch.Tensor, perm: torch.Tensor | None, in_features: int, group_size: int, unit: int
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Each group padded with zero codes to whole steps of `unit` columns (pads read a zero activation)."""
    pad = -group_size % unit
    if not pad:
        return q, perm, group_size
    n, k_int = q.shape
    groups = k_int // group_size
    size = group_size + pad
    q = F.pad(q.view(n, groups, group_size), (0, pad)).view(n, groups * size)
    cols = perm if perm is not None else torch.arange(k_int, dtype=torch.int64)
    cols = torch.where(cols < in_features, cols, -1)  # the canonical zero tail past K reads zero too
    perm = F.pad(cols.view(groups, group_size), (0, pad), value=-1).reshape(-1)
    return q, perm, size


def _blocked(t: torch.Tensor, n: int) -> torch.Tensor:  # [G, N] -> [blocks, G, 16] float32
    pad = -n % BLOCK
    t = F.pad(t.float(), (0, pad)) if pad else t.float()
    return t.unflatten(1, (-1, BLOCK)).permute(1, 0, 2).contiguous()


def pack(
    q: torch.Tensor,  # [N, K_int] uint8 codes (e4m3 bytes for QTYPE_FP8)
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor | None,  # [G, N]; None for e4m3
    perm: torch.Tensor | None,  # [K_int] int64
    in_features: int,
    group_size: int,
    qtype: int,
    portable: bool = False,
    int8_activations: bool | None = None,  # None: native_int8()
) -> QuantWeight | None:
    """The kernel's copy of a canonical weight; None where the library cannot be built (or is turned off)."""
    if load_library(portable) is None:
        return None
    n, k_int = q.shape
    if k_int % group_size:
        raise ValueError(f"K_int {k_int} must be whole groups of {group_size}")
    if perm is not None:
        perm = perm.to(torch.int64)
    if qtype != QTYPE_FP8:  # a group is whole 64-byte steps: 8 columns of 4-bit codes, 4 of 8-bit
        q, perm, group_size = _whole_steps(q, perm, in_features, group_size, 8 if qtype == QTYPE_U4 else 4)
        k_int = q.shape[1]
    pad = -n % BLOCK
    codes = F.pad(q, (0, 0, 0, pad)) if pad else q
    codes = codes.view(-1, BLOCK, k_int)  # [blocks, 16, K_int]
    if qtype == QTYPE_U4:  # byte i of step p: column 8p + i (low nibble), 8p + 4 + i (high)
        codes = codes.view(-1, BLOCK, k_int // 8, 2, 4)
        data = codes[..., 0, :] | (codes[..., 1, :] << 4)
        data = data.transpose(1, 2).contiguous()  # [blocks, K/8, 16, 4]
    elif qtype == QTYPE_U8:
        data = codes.view(-1, BLOCK, k_int // 4, 4).transpose(1, 2).contiguous()  # [blocks, K/4, 16, 4]
    else:
        data = codes.transpose(1, 2).contiguous()  # [blocks, K, 16]
    s = _blocked(scales, n) * (256.0 if qtype == QTYPE_FP8 else 1.0)
    z = _blocked(zeros, n) if zeros is not None else None
    p = perm.contiguous() if perm is not None else None
    if int8_activations is None:
        int8_activations = native_int8(portable)
    int8_activations = int8_activations and qtype != QTYPE_FP8
    return QuantWeight(data, s, z, p, qtype, n, in_features, k_int, group_size, portable, int8_activations)


def pack_bf16(weight: torch.Tensor, portable: bool = False, gated: bool = False) -> QuantWeight | None:
    """A [N, K] bfloat16 weight in the kernel's bfloat16 layout: per 16-row block, each pair of columns
    (2p, 2p + 1) as 16 (row) x 2 values, one 64-byte vector, the operand vdpbf16ps takes as it is. K is
    padded to even with a zero column. None where the library cannot be built (or is turned off).

    gated: a merged [gate | up] weight (N a multiple of 32) whose `linear` is to return silu(gate) * up,
    as ops.silu_and_mul would on the plain output, bit for bit: the blocks then alternate gate and up rows
    of the same 16 outputs (csrc/quant_gemm.c, bf16_weights_gated). None where that cannot run here (no
    AVX512-BF16, N not a multiple of 32, K odd)."""
    if load_library(portable) is None:
        return None
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise TypeError(f"pack_bf16 takes a 2-D bfloat16 weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if gated:
        if portable or not native_bf16() or n % (2 * BLOCK) or k % 2:
            return None
        weight = _interleave_gate_up(weight)
    w = F.pad(weight.detach(), (0, k % 2, 0, -n % BLOCK))  # [N', K_int]
    k_int = w.shape[1]
    data = w.view(torch.int16).view(-1, BLOCK, k_int // 2, 2).transpose(1, 2).contiguous()
    blocks = data.shape[0]
    scales = torch.ones(blocks, 1, BLOCK)
    return QuantWeight(data, scales, None, None, QTYPE_BF16, n, k, k_int, k_int, portable, gated=gated)


def _interleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """[gate | up] rows -> [gate block 0, up block 0, gate block 1, ...]: row blocks of 16 interleaved, so
    that the gated kernels' 2-block tiles hold both halves of 16 outputs."""
    n, k = weight.shape
    inter = n // 2
    halves = [weight[:inter].view(-1, BLOCK, k), weight[inter:].view(-1, BLOCK, k)]
    return torch.stack(halves, 1).reshape(n, k)


def pack_f32(weight: torch.Tensor, gated: bool = False) -> QuantWeight | None:
    """A [N, K] float32 weight in the kernel's float32 layout: per 16-row block, column k as one 64-byte
    vector of the 16 rows ([blocks, K, 16]), the operand of an FMA as it is. None where the kernel cannot
    run it (no AVX-512 in this build, or the library turned off).

    gated: a merged [gate | up] weight (N a multiple of 32) whose `linear` is to return silu(gate) * up,
    as ops.silu_and_mul would on the plain output, bit for bit (csrc/quant_gemm.c, f32_weights_gated);
    None where N is not a multiple of 32."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise TypeError(f"pack_f32 takes a 2-D float32 weight, got {weight.dtype} {tuple(weight.shape)}")
    if not native_f32():
        return None
    n, k = weight.shape
    if gated:
        if n % (2 * BLOCK):
            return None
        weight = _interleave_gate_up(weight)
    w = F.pad(weight.detach(), (0, 0, 0, -n % BLOCK))  # [N', K]
    data = w.view(-1, BLOCK, k).transpose(1, 2).contiguous()
    scales = torch.ones(data.shape[0], 1, BLOCK)
    return QuantWeight(data, scales, None, None, QTYPE_F32, n, k, k, k, gated=gated)


# From this many rows on, bfloat16 activations with 4- / 8-bit codes go to AMX where the CPU has it
# (amx.linear_quant): the codes dequantized to bfloat16 tiles once per row block, against the VNNI kernel's
# per-row arithmetic. Below it the VNNI kernel, which reads the codes once, is faster (bench/quant_gemm.py).
# A row's output therefore depends on which side of this its batch falls, as it does not within either.
AMX_MIN_ROWS = 32


def uses_amx(weight: QuantWeight, dtype: torch.dtype) -> bool:
    """Whether `linear` runs prefill-sized batches of `dtype` activations of this weight on AMX."""
    return (
        dtype == torch.bfloat16
        and weight.qtype in (QTYPE_U4, QTYPE_U8)
        and weight.k_int % amx.K_ALIGN == 0
        and not weight.portable
        and amx.available()
    )


def linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """[..., in] float32 / bfloat16 -> [..., out] in x's dtype: x W^T + b, rounded once."""
    lib = load_library(weight.portable)
    assert lib is not None, "a QuantWeight exists only where the library loaded"
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"quantized CPU linear takes float32 or bfloat16 activations, got {x.dtype}")
    if weight.qtype == QTYPE_F32 and x.dtype != torch.float32:  # the kernel takes float32 rows only
        return linear(x.float(), weight, bias.float() if bias is not None else None).to(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(x.dtype).contiguous()
    rows = x2.shape[0]
    if weight.gated:
        return _linear_gated(lib, x2, weight, bias).reshape(*lead, weight.out_features // 2)
    if rows >= AMX_MIN_ROWS and uses_amx(weight, x.dtype):
        out = amx.linear_quant(
            x2,
            weight.perm,
            weight.data,
            weight.scales,
            weight.zeros,
            weight.qtype,
            weight.k_int,
            weight.group_size,
            weight.out_features,
            bias,
        )
        return out.reshape(*lead, weight.out_features)
    out = torch.empty(rows, weight.out_features, dtype=x.dtype)
    rc = lib.qgemm(
        x2.data_ptr(),
        x2.stride(0),
        int(x.dtype == torch.bfloat16),
        weight.in_features,
        weight.perm.data_ptr() if weight.perm is not None else None,
        weight.data.data_ptr(),
        weight.scales.data_ptr(),
        weight.zeros.data_ptr() if weight.zeros is not None else None,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        out.stride(0),
        rows,
        weight.out_features,
        weight.k_int,
        weight.group_size,
        weight.qtype,
        int(weight.int8_activations),
        torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError("quantized linear could not allocate its scratch memory")
    assert rc == 0, f"qgemm returned {rc}"
    return out.reshape(*lead, weight.out_features)


def _linear_gated(
    lib: ctypes.CDLL, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """[T, in] -> [T, out / 2] = silu(gate) * up through a gated weight (pack_bf16 / pack_f32 with
    gated=True), in the weight's dtype."""
    f32 = weight.qtype == QTYPE_F32
    dtype = torch.float32 if f32 else torch.bfloat16
    if x.dtype != dtype:
        raise TypeError(f"a gated {dtype} weight takes {dtype} activations, got {x.dtype}")
    out = torch.empty(x.shape[0], weight.out_features // 2, dtype=x.dtype)
    rc = (lib.qgemm_f32_gated if f32 else lib.qgemm_bf16_gated)(
        x.data_ptr(),
        x.stride(0),
        weight.data.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        out.stride(0),
        x.shape[0],
        weight.out_features,
        weight.k_int,
        torch.get_num_threads(),
    )
    assert rc == 0, f"the gated GEMM returned {rc}"
    return out
