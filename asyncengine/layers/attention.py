"""Paged attention: the forward context, the KV-cache write and the Attention layer.

The model runner builds one AttentionMetadata per step and enters `forward_context(meta)`; every
Attention layer reads it from there (no set/reset pairs, no metadata threaded through model code) and
hands it to the process's backend (attention_selector).

Imports run one way: attention_backend (metadata, protocol) <- the backends <- attention_selector <- here.

KV-cache layout, per layer: k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
Token slot s lives at block s // block_size, offset s % block_size. The cache holds the model's dtype,
or float8 e5m2 with kv_cache_dtype=fp8_e5m2: keys and values are rounded once, when written,
and every attention of the step (a fresh prompt's over its own keys too) sees them as stored.

Sliding-window layers (Mistral's `sliding_window`, Qwen2/3's "sliding_attention" layers) pass their
window W to the backend: the query at position i sees keys i - W < j <= i, as HF's mask does. The
cache still keeps every key (blocks are not freed behind the window).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from asyncengine.cpu import ops as cpu_ops
from asyncengine.layers.attention_backend import AttentionBackend, AttentionMetadata, SampledRows
from asyncengine.layers.attention_selector import get_attention_backend, set_attention_backend
from asyncengine.layers.rotary import apply_rotary

# AttentionMetadata, AttentionBackend and set_attention_backend live below this module (attention_backend,
# attention_selector) so that the backends need not import it; they are named here too, next to the layer.
__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "SampledRows",
    "forward_context",
    "get_attention_backend",
    "get_attention_metadata",
    "set_attention_backend",
    "write_kv_cache",
]

_current: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    """Makes `meta` the batch every Attention layer sees for the duration of one forward pass."""
    global _current
    previous, _current = _current, meta
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    assert _current is not None, "Attention called outside forward_context()"
    return _current


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Stores this step's keys and values at their slots.

    NOTE: unconditional on purpose (no masking of -1 slots): a data-dependent branch would force a
    device sync, which CUDA-graph capture forbids. Padding rows point at the scratch block the model
    runner allocates past the last real block.
    """
    if k.device.type == "cpu" and cpu_ops.write_kv(k, v, k_cache, v_cache, slot_mapping):
        return
    if (
        k_cache.element_size() == 1
    ):  # float8: a byte copy, as index_copy_ lacks float8 kernels on some devices
        k, v, k_cache, v_cache = (t.view(torch.uint8) for t in (k, v, k_cache, v_cache))
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache of one decoder layer.

    The model runner binds `k_cache` / `v_cache` after it sizes the cache; before that (weight
    loading, memory profiling) the layer attends over this step's keys only.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin [num_tokens, rotary_dim / 2]
        rows: SampledRows | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim], or [len(rows), ...]
        """With `rope`, q and k are rotated here first: on a CPU together with the cache write, in one
        pass. With `rows` (a model's last layer, SampledRows), every row's K/V is written but only those
        rows attend: the output has their rows, in their order."""
        meta = get_attention_metadata()
        fused = None
        if rope is not None:
            if self.k_cache.numel() and self.k_cache.dtype == q.dtype and q.device.type == "cpu":
                fused = cpu_ops.rope_write_kv(
                    q, k, v, rope[0], rope[1], self.k_cache, self.v_cache, meta.slot_mapping, self.head_dim
                )
            if fused is None:
                q, k = apply_rotary(q, *rope, self.head_dim), apply_rotary(k, *rope, self.head_dim)
            else:
                q, k = fused
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() and fused is None:
            # a float8 cache rounds K/V here, once; the attention below then sees them as stored
            # (.to() to the dtype a tensor already has returns it, uncopied)
            k, v = k.to(self.k_cache.dtype), v.to(self.k_cache.dtype)
            write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            k, v = k.to(q.dtype), v.to(q.dtype)
        if rows is not None:
            assert self.k_cache.numel(), "the sampled rows attend over the cache: it must be bound"
            if not len(rows):
                return q.new_empty((0, self.num_heads * self.head_dim))
            q, k, v, meta = q[rows.indices], k[rows.indices], v[rows.indices], rows.meta
        out = get_attention_backend().forward(
            q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window
        )
        return out.reshape(-1, self.num_heads * self.head_dim)
