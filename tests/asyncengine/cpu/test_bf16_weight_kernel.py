"""The quantized kernel's plain bfloat16 weights (cpu/quant_gemm.py pack_bf16, QT_BF16), which carry the
bfloat16 linears of AVX512-BF16 CPUs without AMX: x W^T + b against float64, odd shapes (a K padded to
even, a last block of fewer than 16 rows), strided activations, float32 activations, the portable build,
rows independent of the batch they run in, and rounding to bfloat16 as the scalar path rounds."""

from __future__ import annotations

import pytest
import torch

from asyncengine.cpu import quant_gemm

pytestmark = pytest.mark.skipif(not quant_gemm.available(), reason="no C compiler")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out + b.double() if b is not None else out


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("n,k", [(80, 96), (37, 45), (3, 2), (100, 130)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 40])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_matches_float64(portable: bool, n: int, k: int, m: int, act: torch.dtype) -> None:
    if portable and not quant_gemm.available(portable=True):
        pytest.skip("no portable build")
    gen = torch.Generator().manual_seed(n * 1000 + k * 10 + m)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).to(act)
    x = torch.randn(m, k, generator=gen).to(act)
    packed = quant_gemm.pack_bf16(w, portable=portable)
    assert packed is not None and packed.k_int == k + k % 2
    y = quant_gemm.linear(x, packed, b)
    assert y.dtype == act and y.shape == (m, n)
    want = reference(x, w, b)
    if act == torch.float32:  # products of bfloat16 values are exact in float32: only the sums round
        torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-5)
    else:  # the one rounding of each output to bfloat16 (8 bits of mantissa)
        torch.testing.assert_close(y.double(), want, atol=2e-2, rtol=1 / 128)


def check_strided_rows_and_batch_invariance(packed: quant_gemm.QuantWeight, wide: torch.Tensor) -> None:
    """Rows of `wide`'s columns 10 .. 10 + K (200 apart: read in place, no gather) give the bits of the same
    rows made contiguous, and a row alone the bits it has in the batch (its tile, its neighbours aside)."""
    x = wide[:, 10 : 10 + packed.in_features]
    y = quant_gemm.linear(x, packed, None)
    assert torch.equal(y, quant_gemm.linear(x.contiguous(), packed, None))
    for i in (0, 7, 8, x.shape[0] - 1):
        assert torch.equal(quant_gemm.linear(x[i : i + 1], packed, None), y[i : i + 1])


def test_strided_rows_and_batch_invariance() -> None:
    gen = torch.Generator().manual_seed(1)
    packed = quant_gemm.pack_bf16(torch.randn(64, 96, generator=gen).bfloat16())
    assert packed is not None
    check_strided_rows_and_batch_invariance(packed, torch.randn(20, 200, generator=gen).bfloat16())


def test_bfloat16_rounding_and_nan_as_the_scalar_path() -> None:
    """A whole 16-row block stores with vector code, a partial one through f32_to_bf16: same bits."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(17, 64, generator=gen).bfloat16()
    w[16] = w[0]  # row 16 (the partial block, scalar stores) repeats row 0 (the vector block)
    w[3, 5] = float("nan")
    packed = quant_gemm.pack_bf16(w)
    assert packed is not None
    x = torch.randn(5, 64, generator=gen).bfloat16()
    y = quant_gemm.linear(x, packed, None)
    assert torch.equal(y[:, 16], y[:, 0])
    assert torch.isnan(y[:, 3]).all() and not torch.isnan(y[:, :3]).any()


def test_refuses_other_dtypes() -> None:
    with pytest.raises(TypeError, match="bfloat16"):
        quant_gemm.pack_bf16(torch.randn(4, 4))


needs_native_bf16 = pytest.mark.skipif(not quant_gemm.native_bf16(), reason="no AVX512-BF16 build here")


@needs_native_bf16
def test_gated_packing_refuses_what_it_cannot_run() -> None:
    assert quant_gemm.pack_bf16(torch.randn(2 * 24, 64).bfloat16(), gated=True) is None  # inter not of 16
    assert quant_gemm.pack_bf16(torch.randn(64, 63).bfloat16(), gated=True) is None  # K odd
    gated = quant_gemm.pack_bf16(torch.randn(64, 64).bfloat16(), gated=True)
    with pytest.raises(TypeError, match="bfloat16 activations"):
        quant_gemm.linear(torch.randn(3, 64), gated, None)
