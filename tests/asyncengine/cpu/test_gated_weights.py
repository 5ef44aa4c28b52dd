"""The quantized kernel's gated [gate | up] weights, bfloat16 and float32 (pack_bf16 / pack_f32 with
gated=True, what LlamaMLP.prepack uses on a CPU without AMX): the GEMM's epilogue and the MLP built on it
compute what the unfused ones do (plain kernel, then cpu_ops.silu_and_mul), bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncengine.cpu import amx as cpu_amx
from asyncengine.cpu import gemm as cpu_gemm
from asyncengine.cpu import ops as cpu_ops
from asyncengine.cpu import quant_gemm
from asyncengine.layers.parallel import ParallelContext
from asyncengine.models.llama import LlamaMLP, LlamaOptions

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
PACK = {torch.bfloat16: quant_gemm.pack_bf16, torch.float32: quant_gemm.pack_f32}
NATIVE = {torch.bfloat16: quant_gemm.native_bf16, torch.float32: quant_gemm.native_f32}
dtypes = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])


def needs_kernel(dtype: torch.dtype) -> None:
    if not NATIVE[dtype]():
        pytest.skip(f"no {dtype} build of the kernel here")


@dtypes
@pytest.mark.parametrize("k,inter", [(64, 16), (96, 48), (40, 32), (768, 2048)])
def test_gated_weight_gives_silu_and_mul_bit_for_bit(dtype: torch.dtype, k: int, inter: int) -> None:
    """Every tile regime (1-2 rows on two-pair tiles, 3-8 rows pair by pair, 6-row two-pair tiles beyond,
    an odd last pair; float32 rows streamed from 256 rows on), with and without a bias, through denormals,
    infinities and NaN."""
    needs_kernel(dtype)
    g = torch.Generator().manual_seed(k + inter)
    w = (torch.randn(2 * inter, k, generator=g) * 0.3).to(dtype)
    b = torch.randn(2 * inter, generator=g).to(dtype)
    plain, gated = PACK[dtype](w), PACK[dtype](w, gated=True)
    assert plain is not None and gated is not None and gated.gated and not plain.gated
    for m in (1, 2, 3, 8, 9, 13, 40, 259):
        x = torch.randn(m, k, generator=g).to(dtype)
        x[0, :4] = torch.tensor([1e-39, -3e38, 3e38, 0.0])  # denormal, huge (inf sums), zero
        if m > 2:
            x[2, 1] = float("nan")
        for bias in (None, b):
            expected = cpu_ops.silu_and_mul(quant_gemm.linear(x, plain, bias))
            got = quant_gemm.linear(x, gated, bias)
            assert got.shape == (m, inter) and got.dtype == dtype
            assert torch.equal(got.view(BITS[dtype]), expected.view(BITS[dtype])), (m, bias is None)


def denormal_gate(k: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [gate | up] weight, its bias and rows x whose gate projections are 2e-38 (normal) and up ones 1:
    silu(gate) * up is then ~1e-38, a denormal, which a rounding that flushes them (vcvtneps2bf16 alone)
    zeroes and torch's keeps. (Through the bias: vdpbf16ps flushes denormal products itself.)"""
    w = torch.zeros(2 * inter, k)
    bias = torch.cat([torch.full((inter,), 2e-38), torch.ones(inter)])
    return w.to(dtype), torch.randn(3, k).to(dtype), bias.to(dtype)


@dtypes
def test_gated_weight_keeps_denormals(dtype: torch.dtype) -> None:
    needs_kernel(dtype)
    w, x, bias = denormal_gate(64, 32, dtype)
    plain, gated = PACK[dtype](w), PACK[dtype](w, gated=True)
    assert plain is not None and gated is not None
    got, expected = quant_gemm.linear(x, gated, bias), cpu_ops.silu_and_mul(quant_gemm.linear(x, plain, bias))
    assert (got != 0).all() and got.abs().max() < 1.17e-38  # denormal, not flushed
    assert torch.equal(got.view(BITS[dtype]), expected.view(BITS[dtype]))


@dtypes
def test_gated_mlp_matches_the_unfused_one(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    needs_kernel(dtype)
    monkeypatch.setattr(cpu_amx, "pack", lambda weight, gated=False: None)  # as on a CPU without AMX
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="silu")
    torch.manual_seed(3)
    mlps = [LlamaMLP(cfg, ParallelContext(), LlamaOptions()).to(dtype) for _ in range(2)]
    with torch.no_grad():
        for p in mlps[0].parameters():
            p.normal_(0, 0.1)
        mlps[1].load_state_dict(mlps[0].state_dict())
        assert mlps[0].prepack() and mlps[0].fused_act  # gated
        assert isinstance(mlps[0].gate_up_proj.packed, quant_gemm.QuantWeight)
        assert mlps[1].gate_up_proj.prepack() and not mlps[1].fused_act  # plain, then silu_and_mul
        for mlp in mlps:  # down_proj on the kernel in both
            cpu_gemm.prepack_model(mlp)
        for m in (1, 5, 30):
            x = torch.randn(m, 64).to(dtype)
            assert torch.equal(mlps[0](x), mlps[1](x))


@dtypes
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_any_thread_count_gives_the_same_bits(dtype: torch.dtype, gated: bool) -> None:
    """The GEMM's work is shared out by block-rows (thread_share): a tile cut between two threads at a row,
    blocks split where the batch is one row tile or less, a thread with nothing to do, 7 blocks / 7 pairs
    (tiles that divide evenly among no thread count here). Whatever the thread count every output is
    written, and with the bits one thread gives."""
    needs_kernel(dtype)
    g = torch.Generator().manual_seed(7)
    k, n = 640, 7 * 32 if gated else 7 * 16  # 640 columns: every batch here is worth threads (PAR_MIN)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    packed = PACK[dtype](w, gated=gated)
    assert packed is not None
    saved = torch.get_num_threads()
    try:
        for m in (1, 5, 8, 9, 24, 25, 70):
            x = torch.randn(m, k, generator=g).to(dtype)
            torch.set_num_threads(1)
            one = quant_gemm.linear(x, packed, b)
            want = x.double() @ w.double().t() + b.double()
            if gated:
                want = torch.nn.functional.silu(want[:, : n // 2]) * want[:, n // 2 :]
            torch.testing.assert_close(one.double(), want, atol=0.05, rtol=0.02)
            kept = []  # every result held, so that no output is allocated where an earlier one lies
            for threads in (2, 3, 5, 8, 16):
                torch.set_num_threads(threads)
                kept.append(quant_gemm.linear(x, packed, b))
                assert torch.equal(kept[-1].view(BITS[dtype]), one.view(BITS[dtype])), (m, threads)
    finally:
        torch.set_num_threads(saved)
