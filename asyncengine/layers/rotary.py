"""Rotary position embedding (neox style: the rotated halves are the two halves of the rotary dims).

Frequencies come from HF's own `ROPE_INIT_FUNCTIONS`, so every statically computable rope_scaling type
(linear, llama3, yarn, longrope, ...) matches transformers exactly. The cos/sin table is computed once, in
float32, for every position the model supports; a step only indexes it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine.cpu import ops as cpu_ops
from asyncengine.errors import ModelLoadError


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings as one dict with rope_type and rope_theta, whichever transformers wrote the config.

    transformers >= 5 keeps them in `config.rope_parameters`; 4.x in `rope_theta` plus `rope_scaling`.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        merged = dict(params)
    elif isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError("per-layer-type rope parameters are not supported")
    else:
        merged = dict(getattr(hf_config, "rope_scaling", None) or {})
        merged.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    if merged.get("partial_rotary_factor") is None:
        merged["partial_rotary_factor"] = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return merged


def _init_fn(rope_type: str) -> Any:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}; supported: default, "
            f"{', '.join(t for t in ROPE_INIT_FUNCTIONS if 'dynamic' not in t)}"
        )
    return ROPE_INIT_FUNCTIONS[rope_type]


class RotaryEmbedding(nn.Module):
    """Holds the [max_positions, rotary_dim / 2] cos and sin tables (float32, scaled by attention_scaling)."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        params = rope_parameters(hf_config)
        rope_type = params["rope_type"]
        if "dynamic" in rope_type:
            # NOTE: dynamic NTK rescales the frequencies by the current sequence length, so one sequence's
            # keys would change meaning as it grows; a paged KV cache cannot express that.
            raise ModelLoadError(
                "rope_scaling type 'dynamic' is not supported (it depends on the sequence length)"
            )
        # computed on the CPU in float32 whatever the ambient default device / dtype, then moved once
        device = torch.empty(0).device
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        if rope_type == "default":
            dim = int(head_dim * params["partial_rotary_factor"])
            base = params["rope_theta"]
            inv_freq = 1.0 / (
                base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
            )
            scaling = 1.0
            freqs = positions[:, None] * inv_freq[None, :]  # [P, dim / 2]
        elif rope_type == "longrope":
            # HF switches the whole batch to the long factors once it is longer than the pretraining length;
            # a cache cannot re-rotate stored keys, so like vLLM we use the short factors for positions below
            # original_max_position_embeddings and the long ones above (identical for shorter sequences).
            fn = _init_fn(rope_type)
            original = int(params["original_max_position_embeddings"])
            short, scaling = fn(hf_config, "cpu")
            long, _ = fn(hf_config, "cpu", seq_len=original + 1)
            freqs = torch.where(
                positions[:, None] < original, positions[:, None] * short, positions[:, None] * long
            )
            inv_freq = short
        else:
            inv_freq, scaling = _init_fn(rope_type)(hf_config, "cpu")
            freqs = positions[:, None] * inv_freq.float()[None, :]
        self.rotary_dim = 2 * inv_freq.shape[0]
        self.head_dim = head_dim
        if self.rotary_dim > head_dim:
            raise ModelLoadError(f"rotary dim {self.rotary_dim} exceeds head_dim {head_dim}")
        self.attention_scaling = float(scaling)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer(
            "cos", (freqs.cos() * self.attention_scaling).float().to(device), persistent=False
        )
        self.register_buffer(
            "sin", (freqs.sin() * self.attention_scaling).float().to(device), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T] -> cos, sin [T, rotary_dim / 2]
        """The step's cos / sin rows, looked up once per forward and shared by every layer."""
        cos = cpu_ops.gather_rows(self.cos, positions, dtype)
        if cos is not None:
            sin = cpu_ops.gather_rows(self.sin, positions, dtype)
            assert sin is not None  # same table layout, same ids
            return cos, sin
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_positions={self.cos.shape[0]}"


def apply_rotary(
    x: torch.Tensor,  # [T, num_heads * head_dim]
    cos: torch.Tensor,  # [T, rotary_dim / 2]
    sin: torch.Tensor,
    head_dim: int,
) -> torch.Tensor:  # [T, num_heads * head_dim]
    fused = cpu_ops.rotary(x, cos, sin, head_dim)
    if fused is not None:
        return fused
    half = cos.shape[-1]
    x = x.view(x.shape[0], -1, head_dim)  # [T, H, D]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, rotary_dim / 2]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    # same products and sums as HF's q * cos + rotate_half(q) * sin, so results match bit for bit
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    return out.flatten(1)


def max_rope_positions(hf_config: Any) -> int:
    """Positions the cos/sin table must cover: the context length, or longer when linear scaling extends
    it."""
    max_pos = int(getattr(hf_config, "max_position_embeddings", 2048))
    params = rope_parameters(hf_config)
    if params["rope_type"] == "linear" and params.get("original_max_position_embeddings"):
        max_pos = max(max_pos, int(params["original_max_position_embeddings"] * params["factor"]))
    return max_pos
