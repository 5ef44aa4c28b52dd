"""Paged attention in Triton: a decode kernel (one query per sequence) and a varlen causal prefill kernel.

Both read keys and values from the paged KV cache, laid out per layer as
[num_blocks, block_size, num_kv_heads, head_dim]; token position p of sequence b lives in physical
block block_tables[b, p // block_size] at offset p % block_size. The caller has already written this
step's K/V into the cache. Softmax is computed online (flash-attention style) with fp32 accumulation,
so memory stays O(tile) whatever the context length. Head sizes that are not a power of two (80, 96)
are padded up to the next power of two and masked.

Triton is imported lazily: without it this module still imports, `HAS_TRITON` is False and the
launchers raise. Set TRITON_INTERPRET=1 before importing triton to run the kernels on CPU (slow; tests).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the engine falls back to the torch backend
    triton = None
    tl = None
    HAS_TRITON = False

# Keys per inner-loop tile. Independent of the cache's block_size: each key's physical slot is looked up
# through the block table, so any page size works and tiles may straddle pages.
_DECODE_BLOCK_N = 32
_PREFILL_BLOCK_M = 16  # tl.dot needs at least 16 rows
_PREFILL_BLOCK_N = 32
_NO_WINDOW = 2**30  # a window past any context: the masks need no branch


if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        Q,
        K_cache,
        V_cache,
        Block_tables,
        Seq_lens,
        Out,
        scale,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        stride_ob,
        stride_oh,
        block_size,
        window,  # sliding window: keys seq_len - window .. seq_len - 1 (a huge value: no window)
        GROUP: tl.constexpr,  # query heads per KV head
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # One program per (sequence, query head): a single query row, so plain multiply-and-reduce
        # beats tl.dot (which would need 16 rows) and keeps fp32 exact.
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        seq_len = tl.load(Seq_lens + seq)

        offs_d = tl.arange(0, HEAD_DIM_PAD)  # [D]
        mask_d = offs_d < HEAD_DIM
        q = tl.load(Q + seq * stride_qb + head * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)

        # The running max starts at a finite "minus infinity": exp(-inf - (-inf)) would be NaN for rows
        # whose first tile is fully masked.
        m_i = -1.0e30  # running max of the scores
        l_i = 0.0  # running sum of exp(score - m_i)
        acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)  # [D]
        first = tl.maximum(seq_len - window, 0)  # the first key the window keeps
        for start in range(first // BLOCK_N * BLOCK_N, seq_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)  # [N] key positions
            mask_n = (offs_n < seq_len) & (offs_n >= first)
            block = tl.load(Block_tables + seq * stride_bt + offs_n // block_size, mask=mask_n, other=0)
            offset = offs_n % block_size
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k_ptrs = K_cache + block.to(tl.int64)[:, None] * stride_kb + offset[:, None] * stride_ks
            k = tl.load(k_ptrs + kv_head * stride_kh + offs_d[None, :], mask=mask_kv, other=0.0)  # [N, D]
            scores = tl.sum(q[None, :] * k.to(tl.float32), axis=1) * scale  # [N]
            scores = tl.where(mask_n, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new)  # [N]
            v_ptrs = V_cache + block.to(tl.int64)[:, None] * stride_vb + offset[:, None] * stride_vs
            v = tl.load(v_ptrs + kv_head * stride_vh + offs_d[None, :], mask=mask_kv, other=0.0)  # [N, D]
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)  # seq_len 0 (padding) yields zeros, not NaN
        tl.store(Out + seq * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)

    @triton.jit
    def _paged_prefill_kernel(
        Q,
        K_cache,
        V_cache,
        Block_tables,
        Query_start_loc,
        Seq_lens,
        Out,
        scale,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        stride_ot,
        stride_oh,
        block_size,
        window,  # sliding window: query position p sees keys p - window < j <= p (huge: no window)
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # One program per (sequence, query head, tile of BLOCK_M queries). The sequence's q_len queries
        # are the last q_len positions of its seq_len context, so cached prefixes and chunked prefill
        # need no special case: query row j sits at position context_len + j and sees keys 0..that.
        seq = tl.program_id(0)
        head = tl.program_id(1)
        tile = tl.program_id(2)
        kv_head = head // GROUP
        q_start = tl.load(Query_start_loc + seq)
        q_len = tl.load(Query_start_loc + seq + 1) - q_start
        if tile * BLOCK_M >= q_len:  # the grid is sized for the longest query; shorter ones stop early
            return
        seq_len = tl.load(Seq_lens + seq)
        context_len = seq_len - q_len

        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] query rows within the sequence
        mask_m = offs_m < q_len
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask_d = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)  # [M] token rows in q and out
        q_ptrs = Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [M, D]
        q_pos = context_len + offs_m  # [M] absolute positions of the queries

        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30  # finite, as in the decode kernel
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        # Causality: no query of this tile sees past its last row's position.
        end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
        # ... nor, with a window, before its first row's window
        first = tl.maximum(context_len + tile * BLOCK_M - window + 1, 0)
        for start in range(first // BLOCK_N * BLOCK_N, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)  # [N] key positions
            mask_n = offs_n < end
            block = tl.load(Block_tables + seq * stride_bt + offs_n // block_size, mask=mask_n, other=0)
            offset = offs_n % block_size
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k_ptrs = K_cache + block.to(tl.int64)[:, None] * stride_kb + offset[:, None] * stride_ks
            # a float8 cache (kv_cache_dtype=fp8_e5m2) is widened to the query's dtype here
            k = tl.load(k_ptrs + kv_head * stride_kh + offs_d[None, :], mask=mask_kv, other=0.0).to(
                q.dtype
            )  # [N, D]
            # "ieee" keeps fp32 inputs exact on tensor-core GPUs (default tf32 drops mantissa bits);
            # half-precision inputs ignore it.
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, N] fp32
            visible = (
                (offs_n[None, :] <= q_pos[:, None])
                & (offs_n[None, :] > q_pos[:, None] - window)
                & mask_n[None, :]
            )
            scores = tl.where(visible, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [M]
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])  # [M, N]
            v_ptrs = V_cache + block.to(tl.int64)[:, None] * stride_vb + offset[:, None] * stride_vs
            v = tl.load(v_ptrs + kv_head * stride_vh + offs_d[None, :], mask=mask_kv, other=0.0).to(
                q.dtype
            )  # [N, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _check_common(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """Validates shapes shared by both kernels; returns (GQA group size, head_dim)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the torch attention backend")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3] or num_heads % num_kv_heads:
        raise ValueError(
            f"q heads {num_heads}x{head_dim} do not fit kv heads {num_kv_heads}x{k_cache.shape[3]}"
        )
    # The kernels index the head dim with unit stride (vectorized loads).
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the last (head_dim) dimension of q and the caches must be contiguous")
    return num_heads // num_kv_heads, head_dim


def _check_rows(num_seqs: int, seq_lens: torch.Tensor, block_tables: torch.Tensor) -> None:
    # The kernels index both per sequence without bounds checks.
    if seq_lens.shape[0] < num_seqs or block_tables.shape[0] < num_seqs:
        raise ValueError(
            f"{num_seqs} sequences but {seq_lens.shape[0]} seq_lens and {block_tables.shape[0]} block tables"
        )


def paged_attention_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32, keys per sequence (including this step's)
    scale: float,
    sliding_window: int | None = None,  # attend over the last sliding_window keys only
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of one query per sequence over its paged context.

    Reads only tensors on the device (no host sync), so it can be captured in a CUDA graph. A sequence
    with seq_len 0 (graph padding) gets a zero output row.
    """
    group, head_dim = _check_common(q, k_cache, v_cache)
    num_seqs, num_heads = q.shape[0], q.shape[1]
    _check_rows(num_seqs, seq_lens, block_tables)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.shape[1],
        sliding_window or _NO_WINDOW,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_N=_DECODE_BLOCK_N,
    )
    return out


def paged_attention_prefill(
    q: torch.Tensor,  # [T, Hq, D], sequences concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context after this step (cached + new)
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,  # a query at position p sees keys p - sliding_window < j <= p
) -> torch.Tensor:  # [T, Hq, D]
    """Varlen causal attention: sequence i's queries q[query_start_loc[i]:query_start_loc[i+1]] are the
    last q_len_i positions of its seq_len_i tokens, whose keys and values are all in the paged cache.

    Works for full prefill, chunked prefill, prefix-cached prompts and decode rows mixed in one batch.
    `max_query_len` (a host int) only sizes the grid. Rows of q past query_start_loc[-1] are left
    unwritten.
    """
    group, head_dim = _check_common(q, k_cache, v_cache)
    num_seqs, num_heads = query_start_loc.shape[0] - 1, q.shape[1]
    _check_rows(num_seqs, seq_lens, block_tables)
    out = torch.empty_like(q)
    if num_seqs <= 0 or max_query_len <= 0:
        return out
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, _PREFILL_BLOCK_M))
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.shape[1],
        sliding_window or _NO_WINDOW,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_M=_PREFILL_BLOCK_M,
        BLOCK_N=_PREFILL_BLOCK_N,
    )
    return out
