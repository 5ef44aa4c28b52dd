"""Bit packing of quantized values into int32 words, as the reference tools write their checkpoints.

A word holds 32 / bits values, the first in the lowest bits (GPTQ, compressed-tensors). AWQ packs eight
4-bit values in the order AWQ_ORDER: slot i of a word holds value AWQ_ORDER[i] of its eight.
Values are unsigned (0 .. 2**bits - 1); the formats' zero points and offsets are applied by their readers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order for 4 bits (its GEMM kernel's layout)


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """Packs `values` (unsigned, < 2**bits) along `dim` into int32 words, zero-padding a partial last one."""
    per = 32 // bits
    v = values.to(torch.int32).movedim(dim, -1)
    pad = -v.shape[-1] % per
    if pad:
        v = F.pad(v, (0, pad))
    v = v.unflatten(-1, (-1, per))  # [..., words, per]
    if order is not None:
        v = v[..., list(order)]
    word = torch.zeros(v.shape[:-1], dtype=torch.int32)
    for i in range(per):  # int32 shifts wrap into the sign bit, as the int32 checkpoint tensors hold them
        word |= v[..., i] << (bits * i)
    return word.movedim(-1, dim).contiguous()


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, size: int, order: Sequence[int] | None = None
) -> torch.Tensor:
    """The inverse of pack_int32: [..., words, ...] int32 -> [..., size, ...] uint8 along `dim`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = packed.to(torch.int32).movedim(dim, -1)
    v = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per]; the mask undoes the sign fill
    if order is not None:
        inverse = [0] * per
        for slot, value in enumerate(order):
            inverse[value] = slot
        v = v[..., inverse]
    v = v.flatten(-2)
    if v.shape[-1] < size:
        raise ValueError(f"{v.shape[-1]} packed values along dim {dim}, {size} expected")
    return v[..., :size].to(torch.uint8).movedim(-1, dim).contiguous()
