"""Packed linear layers on CPU (oneDNN, and AMX tiles for bfloat16 where the CPU has AMX): same results as
F.linear, and the original weight is released. The AMX kernel itself: test_cpu_amx.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine.cpu import amx as cpu_amx
from asyncengine.cpu import gemm as cpu_gemm
from asyncengine.cpu import quant_gemm
from asyncengine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncengine.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncengine.layers.parallel import ParallelContext

pytestmark = pytest.mark.skipif(not cpu_gemm.enabled(), reason="torch built without oneDNN")

SINGLE = ParallelContext()


@pytest.fixture
def pack_small_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests use small layers; float32 ones that small stay plain unless the threshold is lifted."""
    monkeypatch.setattr(cpu_gemm, "FP32_PACK_MIN_BYTES", 0)


@pytest.fixture(params=["amx", "bf16kernel", "onednn"])
def bf16_packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """bfloat16 weights go to AMX tiles where the CPU has AMX, else to the quantized kernel's bfloat16
    blocks where it has AVX512-BF16 ("bf16kernel" forces that one), else ("onednn") to oneDNN. float32
    weights go to the kernel's float32 blocks where it has AVX-512 ("bf16kernel" stands for that too),
    else ("onednn") to oneDNN."""
    if request.param != "amx":
        monkeypatch.setattr(cpu_amx, "pack", lambda weight, gated=False: None)
    if request.param == "bf16kernel" and not quant_gemm.native_bf16():
        pytest.skip("no AVX512-BF16 build of the quantized kernel here")
    if request.param == "onednn":
        monkeypatch.setattr(quant_gemm, "native_bf16", lambda: False)
        monkeypatch.setattr(quant_gemm, "native_f32", lambda: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 9, 33, 64, 300])  # 7, 9, 33, 300 run padded to a bucket (oneDNN)
@pytest.mark.parametrize("layer_cls,bias", [(ColumnParallelLinear, True), (RowParallelLinear, False)])
def test_packed_linear_matches_f_linear(dtype, m, layer_cls, bias, pack_small_fp32, bf16_packing) -> None:
    if dtype == torch.float32 and bf16_packing == "amx":
        pytest.skip("no AMX path for float32")
    torch.manual_seed(m)
    layer = layer_cls(96, 80, SINGLE, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if layer.bias is not None:
            layer.bias.normal_()
    w, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(m, 96, dtype=dtype)
    assert layer.prepack()
    assert layer.weight.numel() == 0 and layer.packed is not None  # one copy of the weight, the packed one
    on_amx = dtype == torch.bfloat16 and bf16_packing == "amx" and cpu_amx.available()
    assert isinstance(layer.packed, cpu_amx.AmxWeight) == on_amx
    in_kernel = bf16_packing != "onednn" and (
        (dtype == torch.bfloat16 and not on_amx and quant_gemm.native_bf16())
        or (dtype == torch.float32 and quant_gemm.native_f32())
    )
    assert isinstance(layer.packed, quant_gemm.QuantWeight) == in_kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    y = layer(x)
    assert y.shape == (m, 80) and y.is_contiguous()
    torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)


def test_row_buckets() -> None:
    buckets = [cpu_gemm.bucket_rows(m) for m in range(1, 2049)]
    assert all(b >= m for m, b in enumerate(buckets, 1))
    assert buckets == sorted(buckets)  # monotone: a larger batch never runs at a smaller M
    assert all(cpu_gemm.bucket_rows(b) == b for b in buckets)  # a bucket maps to itself
    assert buckets[:8] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert len(set(buckets)) <= 64  # what bounds oneDNN's primitive cache
    assert max((b - m) / m for m, b in enumerate(buckets, 1) if m > 32) <= 1 / 8


def test_tied_lm_head_keeps_the_embedding(pack_small_fp32) -> None:
    emb = VocabParallelEmbedding(50, 32, SINGLE)
    head = ParallelLMHead(50, 32, SINGLE)
    with torch.no_grad():
        emb.weight.normal_()
    head.tie_to(emb)
    w = emb.weight.detach().clone()
    assert cpu_gemm.prepack_model(torch.nn.ModuleList([emb, head])) == 1
    assert torch.equal(emb.weight, w)  # still there for the lookup
    h = torch.randn(3, 32)
    torch.testing.assert_close(head.compute_logits(h), F.linear(h, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(emb(torch.tensor([1, 49])), w[[1, 49]])


def test_small_float32_weights_stay_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """On oneDNN, below FP32_PACK_MIN_BYTES a float32 layer keeps its weight and F.linear (cheaper per
    call); bfloat16 layers of any size, and float32 ones above it, are packed."""
    monkeypatch.setattr(quant_gemm, "native_f32", lambda: False)
    small = ColumnParallelLinear(256, 512, SINGLE)  # 0.5 MiB of float32
    with torch.no_grad():
        small.weight.normal_()  # not torch.empty's garbage: a NaN there would make torch.equal fail
    w = small.weight.detach().clone()
    assert not small.prepack() and small.packed is None and torch.equal(small.weight, w)
    x = torch.randn(3, 256)
    torch.testing.assert_close(small(x), F.linear(x, w, small.bias))
    assert ColumnParallelLinear(256, 512, SINGLE).to(torch.bfloat16).prepack()
    assert ColumnParallelLinear(512, 1024, SINGLE).prepack()  # 2 MiB of float32


def test_prepack_skips_other_devices_and_dtypes() -> None:
    assert cpu_gemm.prepack(torch.randn(4, 4, dtype=torch.float16)) is None
    assert cpu_gemm.prepack(torch.randn(4)) is None


@pytest.mark.skipif(not quant_gemm.native_f32(), reason="no AVX-512 build of the quantized kernel here")
def test_float32_kernel_takes_every_float32_weight() -> None:
    """Where the quantized kernel runs float32 (AVX-512) it takes float32 weights of any size, below
    oneDNN's threshold too: every linear a kernel call, a row's bits independent of its batch."""
    for n, k in ((64, 64), (256, 512)):
        layer = ColumnParallelLinear(k, n, SINGLE)
        with torch.no_grad():
            layer.weight.normal_()
        w = layer.weight.detach().clone()
        assert layer.prepack() and isinstance(layer.packed, quant_gemm.QuantWeight)
        x = torch.randn(9, k)
        y = layer(x)
        torch.testing.assert_close(y, F.linear(x, w, layer.bias), atol=1e-4, rtol=1e-4)
        assert torch.equal(layer(x[3:4]), y[3:4])
