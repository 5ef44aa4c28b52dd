"""The GEMM a quantized layer runs, picked once per weight at load time: the fused C kernel on CPU
(cpu/quant_gemm.py), the Triton kernel on a GPU (cuda/triton_quant_gemm.py), else PyTorch.

The PyTorch fallback dequantizes the whole weight on every call: correct everywhere, but it reads the
weight twice and writes it once in float32 per step; it exists for machines without a C compiler or
Triton, and as the reference the kernels are tested against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from asyncengine.cpu import quant_gemm as cpu_quant_gemm
from asyncengine.quantization.canonical import Canonical

KernelWeight = Any  # cpu_quant_gemm.QuantWeight | triton_quant_gemm.TritonQuantWeight | Canonical


def prepare(canon: Canonical, device: torch.device) -> KernelWeight:
    """The weight in the layout of the best kernel on `device`."""
    if device.type == "cpu":
        packed = cpu_quant_gemm.pack(
            canon.q, canon.scales, canon.zeros, canon.perm, canon.in_features, canon.group_size, canon.qtype
        )
        if packed is not None:
            return packed
    elif device.type == "cuda":
        from asyncengine.cuda import triton_quant_gemm

        packed = triton_quant_gemm.pack(
            canon.q,
            canon.scales,
            canon.zeros,
            canon.perm,
            canon.in_features,
            canon.group_size,
            canon.qtype,
            device,
        )
        if packed is not None:
            return packed
    return Canonical(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in canon))


def linear(x: torch.Tensor, weight: KernelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """[T, in] -> [T, out] in x's dtype."""
    if isinstance(weight, cpu_quant_gemm.QuantWeight):
        return cpu_quant_gemm.linear(x, weight, bias)
    if isinstance(weight, Canonical):
        return F.linear(weight.gather_input(x), weight.dequantize().to(x.dtype), bias)
    from asyncengine.cuda import triton_quant_gemm

    return triton_quant_gemm.linear(x, weight, bias)


def resident_bytes(weight: KernelWeight) -> int:
    """The bytes a layer's quantized weight keeps (bench/quant_gemm.py reports them per format)."""
    tensors = [t for t in weight if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)
