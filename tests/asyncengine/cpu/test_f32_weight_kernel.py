"""The quantized kernel's plain float32 weights (cpu/quant_gemm.py pack_f32, QT_F32), which carry the
float32 linears of AVX-512 CPUs: x W^T + b against float64 over odd shapes (a last block of fewer than 16
rows, K not a multiple of anything), every tile height and the decode-sized next-panel prefetch, strided
activations, bfloat16 activations (widened), and rows independent of the batch they run in."""

from __future__ import annotations

import pytest
import torch
from test_bf16_weight_kernel import check_strided_rows_and_batch_invariance

from asyncengine.cpu import quant_gemm

pytestmark = pytest.mark.skipif(not quant_gemm.native_f32(), reason="no AVX-512 build of the kernel here")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out + b.double() if b is not None else out


@pytest.mark.parametrize("n,k", [(80, 96), (37, 45), (3, 2), (100, 130), (200, 768)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 40, 130, 300])  # from row 256: streamed stores
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64(n: int, k: int, m: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k * 10 + m)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    packed = quant_gemm.pack_f32(w)
    assert packed is not None and packed.qtype == quant_gemm.QTYPE_F32
    assert packed.data.shape == (-(-n // 16), k, 16)
    y = quant_gemm.linear(x, packed, b)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), reference(x, w, b), atol=1e-4 * k**0.5, rtol=1e-5)


def test_strided_rows_and_batch_invariance() -> None:
    gen = torch.Generator().manual_seed(1)
    packed = quant_gemm.pack_f32(torch.randn(100, 96, generator=gen))
    assert packed is not None
    check_strided_rows_and_batch_invariance(packed, torch.randn(70, 200, generator=gen))


def test_bfloat16_activations_are_widened() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=gen)
    b = torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(5, 64, generator=gen).bfloat16()
    packed = quant_gemm.pack_f32(w)
    assert packed is not None
    y = quant_gemm.linear(x, packed, b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, (x.float() @ w.t() + b.float()).bfloat16())


def test_nan_stays_in_its_column() -> None:
    w = torch.ones(20, 32)
    w[17, 3] = float("nan")  # the partial block
    w[2, 0] = float("nan")  # a whole block
    packed = quant_gemm.pack_f32(w)
    assert packed is not None
    y = quant_gemm.linear(torch.ones(9, 32), packed, None)
    assert torch.isnan(y[:, [2, 17]]).all() and not torch.isnan(y[:, [0, 1, 3, 16, 18, 19]]).any()


def test_refuses_other_dtypes() -> None:
    with pytest.raises(TypeError, match="float32"):
        quant_gemm.pack_f32(torch.randn(4, 4).bfloat16())


def test_gated_packing_refuses_what_it_cannot_run() -> None:
    assert quant_gemm.pack_f32(torch.randn(2 * 24, 64), gated=True) is None  # inter not of 16
    gated = quant_gemm.pack_f32(torch.randn(64, 64), gated=True)
    assert gated is not None
    y = quant_gemm.linear(torch.randn(3, 64).bfloat16(), gated, None)  # widened, as a plain weight's
    assert y.shape == (3, 32) and y.dtype == torch.bfloat16
