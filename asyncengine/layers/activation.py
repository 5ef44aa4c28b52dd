"""Activations, picked by the name a HF config gives (`hidden_act`, `activation_function`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.cpu import ops as cpu_ops
from asyncengine.errors import ModelLoadError

ActFn = Callable[[torch.Tensor], torch.Tensor]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU, written exactly as HF's NewGELUActivation so results match bit
    for bit; on CPU one C pass with the same rounding chain (cpu_ops.gelu_new: only tanh's last float32
    bit may differ) instead of 8 torch ops."""
    fused = cpu_ops.gelu_new(x)
    if fused is not None:
        return fused
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


_ACTIVATIONS: dict[str, ActFn] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_act_fn(name: str) -> ActFn:
    """The activation HF means by `name`; names we do not implement fall back to HF's own ACT2FN."""
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name]
    from transformers.activations import ACT2FN

    if name in ACT2FN:
        return ACT2FN[name]
    raise ModelLoadError(f"unsupported activation {name!r}")


class ActAndMul(nn.Module):
    """act(gate) * up over a fused [gate | up] projection, as a gated MLP computes it."""

    def __init__(self, act_name: str = "silu") -> None:
        super().__init__()
        self.act = get_act_fn(act_name)
        self.is_silu = self.act is F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [num_tokens, inter]
        fused = cpu_ops.silu_and_mul(x) if self.is_silu else None
        if fused is not None:
            return fused
        half = x.shape[-1] // 2
        return self.act(x[..., :half]) * x[..., half:]


class SiluAndMul(ActAndMul):
    """The SwiGLU gate of Llama-style MLPs."""

    def __init__(self) -> None:
        super().__init__("silu")
