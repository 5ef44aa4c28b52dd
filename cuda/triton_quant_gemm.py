"""Weight-only quantized GEMM in Triton (W4A16 / W8A16 / FP8 weights): y = x W^T + b with W as 4- or
8-bit codes or float8 e4m3 bytes, dequantized per tile inside the kernel, accumulated in float32.

Weight layout (`pack`): codes [K_int / (32 / bits), N] int32 packed along K, the first in the lowest
bits (GPTQ's own order, so N is the contiguous, coalesced dim); scales and zero points [G, N] float32,
group g covering internal columns [g * group_size, (g + 1) * group_size). An act-order permutation is
applied to the activations before the kernel (one gather), as the canonical layout prescribes
(asyncengine/quantization/canonical.py). e4m3 bytes are packed as 8-bit codes and decoded in the kernel
from their bits (sign, 4-bit exponent, 3-bit mantissa; 0x7f / 0xff are NaN), exactly, with integer ops
and a bit cast: no float8 hardware type is needed (pre-Hopper GPUs, the interpreter), and the weight is
never dequantized whole, where the PyTorch fallback dequantizes it on every call.

float32 activations multiply in IEEE float32 (no TF32), so results match the dequantized reference to
float32 rounding; bfloat16 / float16 activations meet weights rounded to their dtype.
Triton is imported lazily, as in triton_attention.py; TRITON_INTERPRET=1 runs it on CPU (tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton = None
    tl = None
    HAS_TRITON = False

QTYPE_U4, QTYPE_U8, QTYPE_FP8 = 0, 1, 2  # as asyncengine.quantization.canonical
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32  # tl.dot needs 16 rows; BLOCK_K divides every packed word run


class TritonQuantWeight(NamedTuple):
    qweight: torch.Tensor  # [K_int / (32 / bits), N] int32
    scales: torch.Tensor  # [G, N] float32
    zeros: torch.Tensor | None  # [G, N] float32; None for e4m3
    perm: torch.Tensor | None  # [K_int] int64 input column per internal column, -1 reads zero
    bits: int
    fp8: bool  # codes are e4m3 bytes: w = e4m3(code) * scale
    out_features: int
    in_features: int
    k_int: int
    group_size: int


if HAS_TRITON:

    @triton.jit
    def _quant_gemm_kernel(
        X,
        W,
        S,
        Z,
        B,
        Y,
        M,
        N,
        K,
        stride_xm,
        stride_wk,
        stride_ym,
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
        FP8: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        FP32: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        PER: tl.constexpr = 32 // BITS
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            mask_k = offs_k < K
            x = tl.load(
                X + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )  # [BM, BK]
            wmask = mask_k[:, None] & mask_n[None, :]
            packed = tl.load(W + (offs_k // PER)[:, None] * stride_wk + offs_n[None, :], mask=wmask, other=0)
            codes = (packed >> ((offs_k % PER) * BITS)[:, None]) & ((1 << BITS) - 1)  # [BK, BN]
            group = (offs_k // GROUP)[:, None] * N + offs_n[None, :]
            scale = tl.load(S + group, mask=wmask, other=0.0)
            if FP8:  # e4m3fn from its bits: normal (1 + m / 8) 2^(e - 7), subnormal m 2^-9, NaN at 0x7f
                mag = codes & 0x7F
                e = mag >> 3
                normal = (((e + 120) << 23) | ((mag & 7) << 20)).to(tl.float32, bitcast=True)
                w = tl.where(e == 0, (mag & 7).to(tl.float32) * 0.001953125, normal)
                w = tl.where(mag == 0x7F, float("nan"), w)
                w = tl.where((codes & 0x80) != 0, -w, w) * scale
            else:
                zero = tl.load(Z + group, mask=wmask, other=0.0)
                w = (codes.to(tl.float32) - zero) * scale
            if FP32:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(
            Y + offs_m[:, None] * stride_ym + offs_n[None, :],
            acc.to(Y.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


def pack(
    q: torch.Tensor,  # [N, K_int] uint8 codes
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor | None,  # [G, N]
    perm: torch.Tensor | None,
    in_features: int,
    group_size: int,
    qtype: int,
    device: torch.device,
) -> TritonQuantWeight | None:
    """The kernel's copy of a canonical weight on `device`; None without Triton."""
    if (
        not HAS_TRITON
        or qtype not in (QTYPE_U4, QTYPE_U8, QTYPE_FP8)
        or (zeros is None) != (qtype == QTYPE_FP8)
    ):
        return None
    bits = 4 if qtype == QTYPE_U4 else 8
    per = 32 // bits
    n, k_int = q.shape
    codes = q.t().to(torch.int32)  # [K_int, N]
    pad = -k_int % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, n)])
    codes = codes.view(-1, per, n)
    word = torch.zeros(codes.shape[0], n, dtype=torch.int32)
    for i in range(per):  # int32 shifts wrap into the sign bit; the kernel masks after shifting
        word |= codes[:, i] << (bits * i)
    return TritonQuantWeight(
        word.to(device),
        scales.float().contiguous().to(device),
        zeros.float().contiguous().to(device) if zeros is not None else None,
        perm.to(device) if perm is not None else None,
        bits,
        qtype == QTYPE_FP8,
        n,
        in_features,
        k_int,
        group_size,
    )


def linear(x: torch.Tensor, weight: TritonQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """[M, in] -> [M, out] in x's dtype."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    x2 = x.reshape(-1, x.shape[-1])
    if weight.perm is not None:  # act-order: gather the columns in group order, -1 reading a zero column
        padded = torch.cat([x2, x2.new_zeros(x2.shape[0], 1)], dim=1)
        x2 = padded[:, torch.where(weight.perm >= 0, weight.perm, weight.in_features)]
    elif x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, weight.out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(weight.out_features, BLOCK_N))
    _quant_gemm_kernel[grid](
        x2,
        weight.qweight,
        weight.scales,
        weight.zeros if weight.zeros is not None else weight.scales,  # e4m3 reads no zeros
        bias if bias is not None else y,
        y,
        m,
        weight.out_features,
        x2.shape[1],  # K of x (the canonical K_int after a permutation; codes past it are masked)
        x2.stride(0),
        weight.qweight.stride(0),
        y.stride(0),
        GROUP=weight.group_size,
        BITS=weight.bits,
        FP8=weight.fp8,
        HAS_BIAS=bias is not None,
        FP32=x.dtype == torch.float32,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
    )
    return y.reshape(*x.shape[:-1], weight.out_features)
