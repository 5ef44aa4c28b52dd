"""The PyTorch reference attention backend: exact, runs anywhere, and is what the CPU path uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.layers.attention_backend import AttentionMetadata

# enable_gqa arrived in torch 2.5; older releases get the KV heads repeated instead.
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def sdpa(
    q: torch.Tensor,  # [..., H, L, D]
    k: torch.Tensor,  # [..., Hkv, S, D]
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:  # [..., H, L, D]
    if q.dim() == 3:
        # NOTE: the CPU flash-attention kernel only takes 4-D [B, H, L, D] inputs; 3-D ones fall back to
        # the unfused math path, 4-7x slower on a 512-token prefill (bench: 29 vs 129 GFLOP/s float32)
        return sdpa(q[None], k[None], v[None], attn_mask, is_causal, scale)[0]
    if q.shape[-3] == k.shape[-3]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    if _HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    dtype: torch.dtype,  # the query's: a float8 cache is widened to it
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len].to(dtype)


class TorchAttentionBackend:
    """Varlen causal attention over the paged cache with torch's scaled_dot_product_attention."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if meta.is_decode_only and k_cache.numel():
            return self._decode(q, k_cache, v_cache, meta, scale, sliding_window)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            end = start + q_len
            if seq_len == q_len:  # no cached context: attend over this step's keys directly
                keys, values = k[start:end], v[start:end]
            else:
                keys = gather_kv(k_cache, meta.block_tables[i], seq_len, q.dtype)
                values = gather_kv(v_cache, meta.block_tables[i], seq_len, q.dtype)
            out[start:end] = causal_attention(q[start:end], keys, values, scale, sliding_window)
            start = end
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [B, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [B, num_heads, head_dim]
        num_seqs = meta.num_seqs
        block_size = k_cache.shape[1]
        max_blocks = -(-meta.max_seq_len // block_size)
        tables = meta.block_tables[:num_seqs, :max_blocks].long()  # [B, M]
        keys = k_cache[tables].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [B, Hkv, M * block_size, D]
        values = v_cache[tables].flatten(1, 2).transpose(1, 2).to(q.dtype)
        positions = torch.arange(keys.shape[2], device=q.device)
        seq_lens = meta.seq_lens[:num_seqs, None].to(q.device)
        mask = positions[None, :] < seq_lens  # [B, S]
        if sliding_window:  # the query sits at seq_len - 1
            mask &= positions[None, :] >= seq_lens - sliding_window
        out = sdpa(
            q[:num_seqs].unsqueeze(2), keys, values, mask[:, None, None, :], False, scale
        )  # [B, H, 1, D]
        result = torch.zeros_like(q)
        result[:num_seqs] = out.squeeze(2)
        return result


def causal_attention(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """The queries are the last q_len positions of the context: row j sees keys up to seq_len - q_len + j,
    and with a sliding window W only the last W of those."""
    q_len, seq_len = q.shape[0], keys.shape[0]
    mask = None
    windowed = bool(sliding_window) and seq_len > sliding_window
    if q_len == seq_len and not windowed:
        causal = q_len > 1
    else:
        causal = False
        if q_len > 1 or windowed:
            rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
            cols = torch.arange(seq_len, device=q.device)[None, :]
            mask = cols <= rows
            if windowed:
                mask &= cols > rows - sliding_window
    # [H, q_len, D] over [Hkv, seq_len, D]
    out = sdpa(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), mask, causal, scale)
    return out.transpose(0, 1)
