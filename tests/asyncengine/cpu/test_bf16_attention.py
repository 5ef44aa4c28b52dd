"""The AVX512-BF16 prompt-attention kernel (csrc/bf16_attention.c) against torch's SDPA and an exact float64
softmax, with the error bound of the AMX kernel's tests (both round P to bfloat16 as the flash kernel
does)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from test_amx_attention import check, check_rows_untouched, run_prompts
from test_attention_cpu import build_batch

from asyncengine.cpu.attention import load_amx_library
from asyncengine.cpu.bf16_attention import ENV, bf16_prompt_attention, load_library
from asyncengine.layers.attention_cpu import CpuAttentionBackend
from asyncengine.layers.attention_torch import TorchAttentionBackend, gather_kv

pytestmark = pytest.mark.skipif(
    load_library() is None, reason="the CPU has no AVX512-BF16 (or there is no C compiler)"
)

# (query rows, key rows) of a call's prompts, per case; the float32 kernel's tests take them too
PROMPT_LENS = [
    [(1, 1), (15, 15), (16, 16), (17, 17), (100, 100)],  # fresh prompts around the 16-row tiles
    [(513, 513)],  # one long prompt: several 64-key blocks, the unfused work split
    [(20, 50), (16, 97), (1, 64), (70, 200)],  # chunks after cached context
]


# (heads, KV heads), head_dim, window: 64 and 128 (the unrolled loops) in every combination; the other
# multiples of 32 (the generic loops, a 32-dim P V tail where head_dim % 64 == 32) in fewer
SHAPES = [
    *itertools.product([(12, 12), (12, 2), (12, 1)], [64, 128], [None, 7, 40, 100]),
    *itertools.product([(8, 8), (8, 2)], [32, 96, 160, 256], [None, 40]),
]


@pytest.mark.parametrize("heads,head_dim,window", SHAPES)
@pytest.mark.parametrize("lens", PROMPT_LENS)
def test_matches_sdpa_and_is_as_accurate(heads, head_dim, window, lens) -> None:
    q, k, v, out, seqs = run_prompts(bf16_prompt_attention, lens, heads, head_dim, window)
    for q0, q_len, k0, kv_len in seqs:
        check(out[q0 : q0 + q_len], q[q0 : q0 + q_len], k[k0 : k0 + kv_len], v[k0 : k0 + kv_len], window)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_many_sequences_take_the_fused_split(head_dim) -> None:
    """With 4+ (sequence, KV head) units per thread each thread packs a unit and runs its query tiles."""
    lens = [(n, n) for n in (1, 15, 16, 17, 100, 513, 64, 65)] + [(40, 300), (16, 16)]
    q, k, v, out, seqs = run_prompts(bf16_prompt_attention, lens, (12, 12), head_dim, None)
    for q0, q_len, k0, kv_len in seqs:
        check(out[q0 : q0 + q_len], q[q0 : q0 + q_len], k[k0 : k0 + kv_len], v[k0 : k0 + kv_len], None)


def test_rows_outside_the_call_are_untouched_and_a_row_is_batch_independent() -> None:
    check_rows_untouched(bf16_prompt_attention)


def test_declines_what_it_does_not_cover(monkeypatch) -> None:
    for dim in (48, 80, 288):  # head_dim not a multiple of 32 up to 256: SDPA keeps it
        q = torch.randn(8, 2, dim).to(torch.bfloat16)
        assert not bf16_prompt_attention(q, q, q, torch.empty_like(q), [(0, 8, 0, 8)], 0.1, None)
    q32 = torch.randn(8, 2, 64)  # float32
    assert not bf16_prompt_attention(q32, q32, q32, torch.empty_like(q32), [(0, 8, 0, 8)], 0.1, None)
    monkeypatch.setenv(ENV, "0")  # the switch the benches' A/B use
    q16 = q32.to(torch.bfloat16)
    assert not bf16_prompt_attention(q16, q16, q16, torch.empty_like(q16), [(0, 8, 0, 8)], 0.1, None)


def check_paged_keys(
    kernel: Callable[..., bool],
    dtype: torch.dtype,
    head_dim: int,
    window: int | None,
    check: Callable[..., None],
) -> None:
    """With block tables a prompt kernel reads keys in place from the cache (shuffled blocks), chunks after a
    cached prefix included: the same bits as the same call on the gathered keys, and `check`ed (close to
    SDPA)."""
    lens, context = [40, 1, 23, 30, 130], [0, 30, 50, 16, 70]
    q, _, _, kc, vc, meta = build_batch(lens, context, 12, 2, head_dim, 16, dtype)
    tables = meta.block_tables.to(torch.int32).contiguous()
    seqs, start = [], 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        seqs.append((start, q_len, i, seq_len))
        start += q_len
    paged = torch.zeros_like(q)
    assert kernel(q, kc, vc, paged, seqs, head_dim**-0.5, window, tables)
    for s, n, i, seq_len in seqs:
        keys = gather_kv(kc, meta.block_tables[i], seq_len, q.dtype)
        values = gather_kv(vc, meta.block_tables[i], seq_len, q.dtype)
        alone = torch.zeros_like(q)
        assert kernel(q, keys, values, alone, [(s, n, 0, seq_len)], head_dim**-0.5, window)
        assert torch.equal(paged[s : s + n], alone[s : s + n])
        check(paged[s : s + n], q[s : s + n], keys, values, window)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_keys_match_gathered_ones(head_dim, window) -> None:
    check_paged_keys(bf16_prompt_attention, torch.bfloat16, head_dim, window, check)


@pytest.mark.skipif(load_amx_library() is not None, reason="with AMX the backend takes amx_attention.c")
@pytest.mark.parametrize("query_lens,context_lens", [([40, 1, 23], [0, 30, 0]), ([20, 17, 100], [16, 50, 0])])
@pytest.mark.parametrize("head_dim", [32, 64])  # 32: the bundled default model's, on the generic loops
def test_backend_routes_prompts_to_the_kernel(query_lens, context_lens, head_dim, monkeypatch) -> None:
    """The backend's dense rows go to the kernel (one call, through the block tables) next to decode rows
    of the paged kernel: close to the reference backend, and not what the SDPA fallback gives bit for bit
    (so the kernel did run); with the switch off, the SDPA path."""
    check_backend_routing(query_lens, context_lens, torch.bfloat16, ENV, 2e-2, 2e-2, monkeypatch, head_dim)


def check_backend_routing(
    query_lens: list[int],
    context_lens: list[int],
    dtype: torch.dtype,
    env: str,
    atol: float,
    rtol: float,
    monkeypatch: pytest.MonkeyPatch,
    head_dim: int = 64,
) -> None:
    """The backend's output for a batch of prompt chunks (after `context_lens` cached tokens) and decode
    rows: close to the reference backend's with the prompt kernel (switch `env`) on and off, and not equal
    bit for bit between the two (the kernel ran). The float32 kernel's test calls this too."""
    q, k, v, kc, vc, meta = build_batch(query_lens, context_lens, 8, 2, head_dim, 16, dtype)
    scale = head_dim**-0.5
    got = CpuAttentionBackend().forward(q, k, v, kc, vc, meta, scale)
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, scale)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    monkeypatch.setenv(env, "0")
    sdpa = CpuAttentionBackend().forward(q, k, v, kc, vc, meta, scale)
    torch.testing.assert_close(sdpa, ref, atol=atol, rtol=rtol)
    assert not torch.equal(got, sdpa)


def test_float8_cache_routes_prompts_by_gather() -> None:
    """A float8 cache is not the kernel's dtype: fresh prompts go over this step's keys, chunks after
    context over their widened gathered blocks."""
    q, k, v, kc, vc, meta = build_batch([40, 1, 23], [0, 30, 50], 8, 2, 64, 16, torch.bfloat16)
    kc8, vc8 = kc.to(torch.float8_e5m2), vc.to(torch.float8_e5m2)
    got = CpuAttentionBackend().forward(q, k, v, kc8, vc8, meta, 0.125)
    ref = TorchAttentionBackend().forward(q, k, v, kc8, vc8, meta, 0.125)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


def test_a_denormal_output_is_kept() -> None:
    """The output is rounded to bfloat16 as torch rounds (a denormal kept, not flushed to zero as
    vcvtneps2bf16 alone would): uniform weights over one value of 2e-38 and 39 zeros average to 5e-40.
    (A sum that turns denormal inside vdpbf16ps is flushed by the instruction itself: the values' sums
    stay normal here, only the final division makes a denormal.)"""
    n, heads, dim = 40, 2, 64
    q = torch.zeros(n, heads, dim, dtype=torch.bfloat16)  # every score 0: P = 1 on every seen key
    k = torch.randn(n, heads, dim).bfloat16()
    v = torch.zeros(n, heads, dim, dtype=torch.bfloat16)
    v[0] = 2e-38
    out = torch.empty_like(q)
    assert bf16_prompt_attention(q, k, v, out, [(0, n, 0, n)], dim**-0.5, None)
    last = out[-1].float()  # row 39 sees all 40 keys
    expected = v[:, 0, 0].double().mean()
    assert 0 < expected.abs() < 1.17e-38
    assert (last != 0).all() and torch.allclose(last.double(), expected.expand_as(last), rtol=2**-7)
