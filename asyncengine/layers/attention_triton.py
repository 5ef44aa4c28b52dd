"""The Triton attention backend: paged decode and varlen prefill kernels from asyncengine.cuda.

Decode-only batches use the decode kernel, which reads only device tensors and so can be captured in a
CUDA graph; any batch with a prefill row (prefill, chunked prefill, mixed) uses the prefill kernel.
"""

from __future__ import annotations

import torch

from asyncengine.cuda.triton_attention import HAS_TRITON, paged_attention_decode, paged_attention_prefill
from asyncengine.layers.attention_backend import AttentionMetadata
from asyncengine.layers.attention_torch import TorchAttentionBackend


class TritonAttentionBackend:
    """Implements the AttentionBackend protocol with Triton paged-attention kernels."""

    def __init__(self) -> None:
        if not HAS_TRITON:
            raise RuntimeError("TritonAttentionBackend needs triton (pip install 'asyncengine[gpu]')")
        # Before the KV cache is bound (weight loading, memory profiling) there is no paged cache to
        # read; the reference backend attends over this step's keys directly in that case.
        self._no_cache = TorchAttentionBackend()

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], already in the cache
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if not k_cache.numel():
            return self._no_cache.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
        if meta.is_decode_only:
            # One query row per sequence; rows beyond meta.num_seqs (graph padding) carry seq_len 0 in
            # the padded tensors and come back as zeros.
            return paged_attention_decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window
            )
        return paged_attention_prefill(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.max_query_len,
            scale,
            sliding_window,
        )
