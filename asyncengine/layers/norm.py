"""RMSNorm and LayerNorm with an optional fused residual add, computed in float32 the way HF computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.cpu import ops as cpu_ops


class _ResidualNorm(nn.Module):
    """A norm with a fused residual add: `fused(x, residual)` is its C pass on CPU (None where it does not
    apply), `reference(x)` its torch code, the same result up to float32 summation order."""

    def fused(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        raise NotImplementedError

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        fused = self.fused(x, None) if x.dim() == 2 else None
        return fused[0] if fused is not None else self.reference(x)

    def fused_add(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor,  # [num_tokens, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual = x + residual)
        """Adds the residual stream and normalises: one call where a pre-norm block has two steps."""
        fused = self.fused(x, residual)
        if fused is not None:
            out, new_residual = fused
            assert new_residual is not None
            return out, new_residual
        x = x + residual
        return self.forward(x), x


class RMSNorm(_ResidualNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def fused(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return cpu_ops.rms_norm(x, self.weight, self.eps, residual)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: HF normalises in float32 but multiplies by the weight in the input dtype; do the same so
        # bf16 / fp16 results match the reference.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def per_head(self, x: torch.Tensor, head_dim: int) -> torch.Tensor:  # [T, H * D] -> [T, H * D]
        """Each head_dim-wide head of every row normalised on its own (the weight is [head_dim])."""
        fused = cpu_ops.rms_norm_heads(x, self.weight, self.eps, head_dim)
        if fused is not None:
            return fused
        return self.forward(x.unflatten(-1, (-1, head_dim))).flatten(1)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class LayerNorm(_ResidualNorm):
    """nn.LayerNorm's parameters and result (GPT-2's ln_1 / ln_2 / ln_f), with RMSNorm's fused residual add;
    on CPU one C pass per row (cpu_ops.layer_norm: float32 moments, equal to torch's up to their summation
    order)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        self.eps = eps

    def fused(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return cpu_ops.layer_norm(x, self.weight, self.bias, self.eps, residual)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, bias={self.bias is not None}"
