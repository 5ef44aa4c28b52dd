"""The AMX prompt-attention kernel (csrc/amx_attention.c) against torch's SDPA and an exact float64
softmax."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_attention_cpu import build_batch

from asyncengine.cpu.attention import amx_prompt_attention, load_amx_library
from asyncengine.layers.attention_cpu import CpuAttentionBackend
from asyncengine.layers.attention_torch import TorchAttentionBackend, causal_attention, gather_kv

pytestmark = pytest.mark.skipif(load_amx_library() is None, reason="no AMX-BF16 (or no C compiler)")


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """float64 causal attention of q [L, H, D] as the last L positions over k, v [S, Hkv, D]."""
    q_len, seq_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qq = q.double().transpose(0, 1)
    kk, vv = (t.double().transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
    s = qq @ kk.transpose(1, 2) * q.shape[2] ** -0.5
    rows = torch.arange(q_len)[:, None] + (seq_len - q_len)
    cols = torch.arange(seq_len)[None, :]
    mask = cols <= rows
    if window:
        mask &= cols > rows - window
    return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ vv).transpose(0, 1)


@pytest.mark.parametrize(
    "heads,head_dim", [((4, 4), 64), ((8, 2), 128), ((6, 1), 32), ((2, 2), 256), ((4, 2), 96)]
)
@pytest.mark.parametrize("window", [None, 7, 40, 150])
@pytest.mark.parametrize(
    "lens",
    [
        [(1, 1), (15, 15), (16, 16), (17, 17), (100, 100)],  # fresh prompts around the 16-row tiles
        [(33, 33), (300, 300)],
        [(20, 50), (16, 97), (1, 64)],  # chunks after cached context (the gathered path)
        [(300, 700), (40, 300)],  # many key blocks: the online softmax's rescaling, windows across blocks
    ],
)
def test_matches_sdpa_and_is_as_accurate(heads, head_dim, window, lens) -> None:
    q, k, v, out, seqs = run_prompts(amx_prompt_attention, lens, heads, head_dim, window)
    for q0, q_len, k0, kv_len in seqs:
        check(out[q0 : q0 + q_len], q[q0 : q0 + q_len], k[k0 : k0 + kv_len], v[k0 : k0 + kv_len], window)


def run_prompts(
    kernel: Callable[..., bool],
    lens: list[tuple[int, int]],
    heads: tuple[int, int],
    head_dim: int,
    window: int | None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple:
    """Prompts of (query rows, key rows) through a prompt kernel (amx_prompt_attention's signature), keys
    and values strided views of one projection output as the model hands them over; checks that nothing
    was written outside the rows. Returns q, k, v, out and the (q0, q_len, k0, kv_len) of each prompt."""
    num_heads, num_kv_heads = heads
    torch.manual_seed(0)
    t, s = sum(q for q, _ in lens), sum(kv for _, kv in lens)
    q = torch.randn(t, num_heads, head_dim).to(dtype)
    kv = torch.randn(s, 2, num_kv_heads, head_dim).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    sentinel = torch.full((t + 3, num_heads, head_dim), 7.0, dtype=dtype)
    out = sentinel[1 : t + 1]
    seqs, qs, ks = [], 0, 0
    for q_len, kv_len in lens:
        seqs.append((qs, q_len, ks, kv_len))
        qs, ks = qs + q_len, ks + kv_len
    assert kernel(q, k, v, out, seqs, head_dim**-0.5, window)
    assert (sentinel[0] == 7).all() and (sentinel[t + 1 :] == 7).all()  # nothing written outside the rows
    return q, k, v, out, seqs


def check(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> None:
    """got against SDPA (close) and against the exact result: both round P to bfloat16 before P V, so their
    errors against the exact result are alike."""
    ref = causal_attention(q, k, v, q.shape[2] ** -0.5, window)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    e = exact(q, k, v, window)
    err_kernel, err_sdpa = (got.double() - e).abs().mean(), (ref.double() - e).abs().mean()
    assert err_kernel <= 1.1 * err_sdpa + 1e-6


def check_rows_untouched(kernel: Callable[..., bool], dtype: torch.dtype = torch.bfloat16) -> None:
    """A prompt kernel leaves the rows outside its call alone, and a row's result does not depend on the
    other prompts of the call (the bfloat16 and float32 kernels' tests call this too)."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(40, 4, 64).to(dtype) for _ in range(3))
    alone = torch.zeros_like(q)
    assert kernel(q, k, v, alone, [(10, 30, 10, 30)], 0.125, None)
    assert (alone[:10] == 0).all()
    together = torch.zeros_like(q)
    assert kernel(q, k, v, together, [(0, 10, 0, 10), (10, 30, 10, 30)], 0.125, None)
    assert torch.equal(alone[10:], together[10:])


def test_rows_outside_the_call_are_untouched_and_a_row_is_batch_independent() -> None:
    check_rows_untouched(amx_prompt_attention)


def test_declines_what_it_does_not_cover() -> None:
    q = torch.randn(8, 2, 80).to(torch.bfloat16)  # head_dim not a multiple of 32
    assert not amx_prompt_attention(q, q, q, torch.empty_like(q), [(0, 8, 0, 8)], 0.1, None)
    q32 = torch.randn(8, 2, 64)  # float32: torch's SDPA keeps it
    assert not amx_prompt_attention(q32, q32, q32, torch.empty_like(q32), [(0, 8, 0, 8)], 0.1, None)
    q64 = torch.randn(8, 2, 64).to(torch.bfloat16)  # a negative scale: the row maxima would be minima
    assert not amx_prompt_attention(q64, q64, q64, torch.empty_like(q64), [(0, 8, 0, 8)], -0.1, None)


@pytest.mark.parametrize("query_lens,context_lens", [([40, 1, 23], [0, 30, 0]), ([20, 17], [16, 50])])
def test_backend_routes_prompts_to_the_kernel(query_lens, context_lens) -> None:
    """The backend's dense rows (fresh prompts in one call, chunks after context one call each) next to
    decode rows of the paged kernel: close to the reference backend."""
    q, k, v, kc, vc, meta = build_batch(query_lens, context_lens, 8, 2, 64, 16, torch.bfloat16)
    got = CpuAttentionBackend().forward(q, k, v, kc, vc, meta, 0.125)
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.125)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 20])
def test_paged_keys_match_gathered_ones(window) -> None:
    """With block tables the kernel reads keys in place from the cache (shuffled blocks): the same bits
    as the same call on the gathered keys."""
    q, _, _, kc, vc, meta = build_batch([40, 1, 23, 30], [0, 30, 50, 16], 8, 2, 64, 16, torch.bfloat16)
    tables = meta.block_tables.to(torch.int32).contiguous()
    seqs, start = [], 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        seqs.append((start, q_len, i, seq_len))
        start += q_len
    paged = torch.zeros_like(q)
    assert amx_prompt_attention(q, kc, vc, paged, seqs, 0.125, window, tables)
    for s, n, i, seq_len in seqs:
        keys = gather_kv(kc, meta.block_tables[i], seq_len, q.dtype)
        values = gather_kv(vc, meta.block_tables[i], seq_len, q.dtype)
        alone = torch.zeros_like(q)
        assert amx_prompt_attention(q, keys, values, alone, [(s, n, 0, seq_len)], 0.125, window)
        assert torch.equal(paged[s : s + n], alone[s : s + n])


def test_float8_cache_routes_prompts_by_gather() -> None:
    """A float8 cache is not the kernel's dtype: fresh prompts go over this step's keys, chunks after
    context over their widened gathered blocks."""
    q, k, v, kc, vc, meta = build_batch([40, 1, 23], [0, 30, 50], 8, 2, 64, 16, torch.bfloat16)
    kc8, vc8 = kc.to(torch.float8_e5m2), vc.to(torch.float8_e5m2)
    got = CpuAttentionBackend().forward(q, k, v, kc8, vc8, meta, 0.125)
    ref = TorchAttentionBackend().forward(q, k, v, kc8, vc8, meta, 0.125)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
