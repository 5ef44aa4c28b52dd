"""The float32 prompt-attention kernel (csrc/f32_attention.c) against a float64 softmax and torch's SDPA: as
accurate as SDPA (both keep every product and P in float32), the paged path equal bit for bit to the same
call on gathered keys, and the backend routing float32 prompt chunks to it."""

from __future__ import annotations

import pytest
import torch
from test_amx_attention import check_rows_untouched, exact, run_prompts
from test_bf16_attention import PROMPT_LENS, check_backend_routing, check_paged_keys

from asyncengine.cpu.f32_attention import ENV, f32_prompt_attention, load_library
from asyncengine.layers.attention_torch import causal_attention

pytestmark = pytest.mark.skipif(
    load_library() is None, reason="the CPU has no AVX-512 (or there is no C compiler)"
)


def check(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> None:
    """got against SDPA (float32-close) and against the exact result: no less accurate than SDPA."""
    ref = causal_attention(q, k, v, q.shape[2] ** -0.5, window)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    e = exact(q, k, v, window)
    err_kernel, err_sdpa = (got.double() - e).abs().max(), (ref.double() - e).abs().max()
    assert err_kernel <= 2 * err_sdpa + 1e-6


@pytest.mark.parametrize(
    "heads,head_dim", [((12, 12), 64), ((8, 2), 128), ((6, 1), 16), ((2, 2), 256), ((4, 2), 80)]
)
@pytest.mark.parametrize("window", [None, 7, 40, 150])
@pytest.mark.parametrize("lens", PROMPT_LENS)
def test_matches_sdpa_and_is_as_accurate(heads, head_dim, window, lens) -> None:
    q, k, v, out, seqs = run_prompts(f32_prompt_attention, lens, heads, head_dim, window, torch.float32)
    for q0, q_len, k0, kv_len in seqs:
        check(out[q0 : q0 + q_len], q[q0 : q0 + q_len], k[k0 : k0 + kv_len], v[k0 : k0 + kv_len], window)


def test_many_sequences_take_the_fused_split() -> None:
    """With 4+ (sequence, KV head) units per thread each thread packs a unit and runs its query tiles."""
    lens = [(n, n) for n in (1, 15, 16, 17, 100, 513, 64, 65)] + [(40, 300), (16, 16)]
    q, k, v, out, seqs = run_prompts(f32_prompt_attention, lens, (12, 12), 64, None, torch.float32)
    for q0, q_len, k0, kv_len in seqs:
        check(out[q0 : q0 + q_len], q[q0 : q0 + q_len], k[k0 : k0 + kv_len], v[k0 : k0 + kv_len], None)


def test_rows_outside_the_call_are_untouched_and_a_row_is_batch_independent() -> None:
    check_rows_untouched(f32_prompt_attention, torch.float32)


def test_declines_what_it_does_not_cover(monkeypatch) -> None:
    q = torch.randn(8, 2, 72)  # head_dim not a multiple of 16: SDPA keeps it
    assert not f32_prompt_attention(q, q, q, torch.empty_like(q), [(0, 8, 0, 8)], 0.1, None)
    q16 = torch.randn(8, 2, 64).to(torch.bfloat16)  # bfloat16: the bfloat16 kernels' (or SDPA's)
    assert not f32_prompt_attention(q16, q16, q16, torch.empty_like(q16), [(0, 8, 0, 8)], 0.1, None)
    monkeypatch.setenv(ENV, "0")  # the switch the benches' A/B use
    q32 = torch.randn(8, 2, 64)
    assert not f32_prompt_attention(q32, q32, q32, torch.empty_like(q32), [(0, 8, 0, 8)], 0.1, None)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_keys_match_gathered_ones(head_dim, window) -> None:
    check_paged_keys(f32_prompt_attention, torch.float32, head_dim, window, check)


@pytest.mark.parametrize("query_lens,context_lens", [([40, 1, 23], [0, 30, 0]), ([20, 17, 100], [16, 50, 0])])
def test_backend_routes_float32_prompts_to_the_kernel(query_lens, context_lens, monkeypatch) -> None:
    """The backend's dense float32 rows go to the kernel (one call, through the block tables) next to decode
    rows of the paged kernel: close to the reference backend, and not SDPA's result bit for bit (so the
    kernel did run); with the switch off, the SDPA path."""
    check_backend_routing(query_lens, context_lens, torch.float32, ENV, 2e-5, 1e-4, monkeypatch)
