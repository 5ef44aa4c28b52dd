"""Triton paged attention (decode and varlen prefill) against the torch reference backend.

Without CUDA the kernels run in Triton's interpreter on CPU, which is slow: shapes stay tiny and the
parameters cover each head size / GQA ratio / block size pairwise rather than as a full product.
"""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before the kernels are decorated with @triton.jit (torch itself does not import triton).
    os.environ["TRITON_INTERPRET"] = "1"

import importlib
import importlib.util
import sys

import pytest

from asyncengine.layers.attention import AttentionMetadata, write_kv_cache
from asyncengine.layers.attention_torch import TorchAttentionBackend

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.125


@pytest.fixture(scope="module")
def kernels():
    if not HAS_TRITON:
        pytest.skip("triton not installed")
    import asyncengine.cuda.triton_attention as mod

    if DEVICE == "cpu" and type(mod._paged_decode_kernel).__name__ != "InterpretedFunction":
        # The interpreter patches triton.language when triton is first imported; too late to switch now.
        pytest.skip("triton was imported before TRITON_INTERPRET=1; set it in tests/conftest.py for CPU runs")
    return mod


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """Random q and context K/V written into a paged cache through random, non-contiguous block tables."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # spare blocks hold garbage the kernels must not read
    width = max(blocks_needed) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    used = 0
    q_rows, k_rows, v_rows, slots = [], [], [], []
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        table = perm[used : used + blocks_needed[i]]
        used += blocks_needed[i]
        block_tables[i, : len(table)] = table.int()
        positions = torch.arange(seq_len)
        seq_slots = table[positions // block_size] * block_size + positions % block_size
        context_k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        context_v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        write_kv_cache(context_k, context_v, k_cache, v_cache, seq_slots)  # cached prefix + this step
        q_rows.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        k_rows.append(context_k[seq_len - q_len :])
        v_rows.append(context_v[seq_len - q_len :])
        slots.append(seq_slots[seq_len - q_len :])
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEVICE),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    move = lambda t: t.to(DEVICE)
    return (
        move(torch.cat(q_rows)),
        move(torch.cat(k_rows)),
        move(torch.cat(v_rows)),
        move(k_cache),
        move(v_cache),
        meta,
    )


# (head_dim, GQA group, block_size, num_kv_heads): every value of each axis appears with several others.
CASES = [
    (64, 1, 16, 2),
    (80, 2, 32, 2),
    (128, 8, 16, 1),
    (80, 8, 16, 1),
    (64, 2, 32, 1),
    (128, 1, 32, 1),
]


def reference(q, k, v, k_cache, v_cache, meta):
    return TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, SCALE)


@pytest.mark.parametrize("head_dim,group,block_size,num_kv_heads", CASES)
def test_decode_matches_reference(kernels, head_dim, group, block_size, num_kv_heads):
    # One token, exactly one block, crossing one boundary, crossing two.
    seq_lens = [1, block_size, block_size + 5, 2 * block_size + 7]
    q, k, v, k_cache, v_cache, meta = make_batch([1] * 4, seq_lens, num_kv_heads, group, head_dim, block_size)
    out = kernels.paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE)
    torch.testing.assert_close(out, reference(q, k, v, k_cache, v_cache, meta), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim,group,block_size,num_kv_heads", CASES)
def test_prefill_matches_reference(kernels, head_dim, group, block_size, num_kv_heads):
    # Full prefill crossing a block boundary; prefix-cached prompt (q_len < seq_len) whose query tile
    # spans the 16-row kernel tile; a decode row in a mixed batch; a short chunk after two blocks.
    query_lens = [block_size + 3, 18, 1, 4]
    seq_lens = [block_size + 3, block_size + 20, block_size + 1, 2 * block_size + 4]
    q, k, v, k_cache, v_cache, meta = make_batch(
        query_lens, seq_lens, num_kv_heads, group, head_dim, block_size
    )
    out = kernels.paged_attention_prefill(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len, SCALE
    )
    torch.testing.assert_close(out, reference(q, k, v, k_cache, v_cache, meta), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 9, 40])
def test_sliding_window(kernels, window):
    """A query at position p sees keys p - window < j <= p: decode rows whose window starts mid-tile and
    mid-block, and prefill tiles (a fresh prompt, chunks after context, a decode row in a mixed batch)."""
    seq_lens = [1, 20, 45, 70]
    q, k, v, k_cache, v_cache, meta = make_batch([1] * 4, seq_lens, 2, 2, 64, 16)
    ref = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, SCALE, window)
    out = kernels.paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE, window)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    q, k, v, k_cache, v_cache, meta = make_batch([37, 18, 1, 4], [37, 50, 33, 70], 2, 2, 64, 16)
    ref = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, SCALE, window)
    out = kernels.paged_attention_prefill(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        meta.max_query_len,
        SCALE,
        window,
    )
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@needs_triton
def test_backend_routes_decode_and_mixed(kernels):
    from asyncengine.layers.attention_triton import TritonAttentionBackend

    backend = TritonAttentionBackend()
    for query_lens, seq_lens in (([1, 1], [9, 30]), ([7, 1], [7, 20])):
        q, k, v, k_cache, v_cache, meta = make_batch(query_lens, seq_lens, 2, 2, 80, 16, seed=3)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, SCALE)
        torch.testing.assert_close(out, reference(q, k, v, k_cache, v_cache, meta), atol=1e-4, rtol=1e-4)
    # Before the KV cache is bound the backend attends over this step's keys, like the reference.
    q, k, v, _, _, meta = make_batch([6], [6], 2, 2, 64, 16, seed=4)
    empty = torch.empty(0, device=DEVICE)
    out = backend.forward(q, k, v, empty, empty, meta, SCALE)
    torch.testing.assert_close(out, reference(q, k, v, empty, empty, meta), atol=1e-5, rtol=1e-5)


def test_decode_padding_rows_and_strided_q(kernels):
    q, k, v, k_cache, v_cache, meta = make_batch([1] * 3, [5, 20, 1], 2, 2, 64, 16, seed=5)
    # Graph padding: seq_len 0 reads nothing and yields zeros (not NaN).
    seq_lens = meta.seq_lens.clone()
    seq_lens[2] = 0
    out = kernels.paged_attention_decode(q, k_cache, v_cache, meta.block_tables, seq_lens, SCALE)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    expected = reference(q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(out[:2], expected[:2], atol=1e-4, rtol=1e-4)
    # q as a view into a fused qkv projection: rows are strided, the head dim is contiguous.
    fused = torch.randn(3, q.shape[1] * 64 + 2 * 2 * 64, device=DEVICE)
    fused[:, : q.shape[1] * 64] = q.reshape(3, -1)
    q_view = fused[:, : q.shape[1] * 64].view(3, q.shape[1], 64)
    assert not q_view.is_contiguous()
    out = kernels.paged_attention_decode(q_view, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_prefill_half_precision(kernels):
    q, k, v, k_cache, v_cache, meta = make_batch([20, 3], [20, 40], 1, 2, 64, 16, dtype=torch.float16, seed=6)
    out = kernels.paged_attention_prefill(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len, SCALE
    )
    expected = reference(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


def test_shape_errors(kernels):
    q, _, _, k_cache, v_cache, meta = make_batch([1, 1], [3, 4], 2, 1, 64, 16)
    with pytest.raises(ValueError, match="heads"):
        kernels.paged_attention_decode(
            q[:, :, :32], k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE
        )
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens[:1], SCALE)


def test_module_imports_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    import asyncengine.cuda

    path = os.path.join(os.path.dirname(asyncengine.cuda.__file__), "triton_attention.py")
    spec = importlib.util.spec_from_file_location("_triton_attention_without_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.HAS_TRITON is False
    with pytest.raises(RuntimeError, match="triton is not installed"):
        module.paged_attention_decode(
            torch.zeros(1, 1, 8),
            torch.zeros(1, 1, 1, 8),
            torch.zeros(1, 1, 1, 8),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            1.0,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache(kernels, dtype):
    """kv_cache_dtype=fp8_e5m2: both kernels widen float8 e5m2 K/V as they load them."""
    q, k, v, k_cache, v_cache, meta = make_batch([5, 1, 1], [21, 9, 40], 1, 2, 64, 16, dtype=dtype, seed=7)
    e5m2 = torch.float8_e5m2
    k_cache, v_cache = k_cache.to(e5m2), v_cache.to(e5m2)
    k, v = k.to(e5m2).to(dtype), v.to(e5m2).to(dtype)  # what the Attention layer hands the backend
    expected = reference(q.float(), k.float(), v.float(), k_cache, v_cache, meta)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    out = kernels.paged_attention_prefill(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len, SCALE
    )
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    rows = meta.query_start_loc[1:] - 1  # each sequence's last row, as a decode step over its context
    out = kernels.paged_attention_decode(
        q[rows.long()], k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE
    )
    torch.testing.assert_close(out.float(), expected[rows.long()], atol=tol, rtol=tol)
