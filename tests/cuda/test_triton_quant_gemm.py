"""The Triton W4A16 / W8A16 GEMM against the dequantized weight (on CPU: Triton's interpreter, so the
shapes stay tiny), with an act-order permutation, partial groups and blocks, and a bias."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (tests/conftest.py sets it too)

import importlib.util

import pytest

from asyncengine.quantization import kernels
from asyncengine.quantization.canonical import QTYPE_FP8, QTYPE_U4, QTYPE_U8, build

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def layer(qtype: int, n: int, k: int, group: int, act_order: bool):
    gen = torch.Generator().manual_seed(0)
    groups = torch.arange(k) // group
    if act_order:
        groups = groups[torch.randperm(k, generator=gen)]
    count = int(groups.max()) + 1
    top = 16 if qtype == QTYPE_U4 else 256
    q = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(count, n, generator=gen) * 0.05 + 0.01
    zeros = torch.randint(0, top, (count, n), generator=gen).float()
    return build(q, groups, scales, zeros, qtype)


@pytest.mark.parametrize(
    ("qtype", "n", "k", "group", "act_order"),
    [(QTYPE_U4, 40, 96, 64, False), (QTYPE_U4, 64, 64, 32, True), (QTYPE_U8, 24, 72, 72, False)],
)
@pytest.mark.parametrize("m", [1, 19])
def test_triton_quant_gemm_matches_the_dequantized_weight(qtype, n, k, group, act_order, m) -> None:
    from asyncengine.cuda import triton_quant_gemm

    canon = layer(qtype, n, k, group, act_order)
    args = (canon.q, canon.scales, canon.zeros, canon.perm, canon.in_features, canon.group_size, canon.qtype)
    weight = triton_quant_gemm.pack(*args, torch.device(DEVICE))
    assert weight is not None
    dense = canon.dequantize_original()
    x, bias = torch.randn(m, k), torch.randn(n)
    got = triton_quant_gemm.linear(x.to(DEVICE), weight, bias.to(DEVICE)).cpu()
    torch.testing.assert_close(got, x @ dense.t() + bias, rtol=1e-5, atol=1e-4)
    if DEVICE == "cuda":  # bfloat16 activations meet bfloat16-rounded weights
        got = triton_quant_gemm.linear(x.to(DEVICE, torch.bfloat16), weight, None).float().cpu()
        torch.testing.assert_close(got, x @ dense.t(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(("n", "k", "group"), [(40, 64, 64), (24, 96, 32)])  # per channel, block scales
def test_triton_float8_weights_match_the_dequantized_weight(n: int, k: int, group: int) -> None:
    """e4m3 bytes decoded from their bits in the kernel: every byte value (subnormals, the largest
    normals, both signs) against torch's float8_e4m3fn conversion."""
    from asyncengine.cuda import triton_quant_gemm

    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    q[q & 0x7F == 0x7F] = 0x7E  # no NaN weights: they would make every output NaN
    q[0, :] = torch.arange(k, dtype=torch.uint8)  # small magnitudes: zero and the subnormals
    groups = torch.arange(k) // group
    scales = torch.rand(k // group, n, generator=gen) * 0.05 + 0.01
    canon = build(q, groups, scales, None, QTYPE_FP8)
    args = (canon.q, canon.scales, canon.zeros, canon.perm, canon.in_features, canon.group_size, canon.qtype)
    weight = triton_quant_gemm.pack(*args, torch.device(DEVICE))
    assert weight is not None and weight.fp8
    assert isinstance(kernels.prepare(canon, torch.device(DEVICE)), triton_quant_gemm.TritonQuantWeight) == (
        DEVICE == "cuda"
    )
    dense = canon.dequantize_original()
    x, bias = torch.randn(5, k), torch.randn(n)
    got = triton_quant_gemm.linear(x.to(DEVICE), weight, bias.to(DEVICE)).cpu()
    torch.testing.assert_close(got, x @ dense.t() + bias, rtol=1e-5, atol=1e-4)
    one_hot = torch.eye(k)[:3]  # single columns: each output is one decoded weight times its scale
    torch.testing.assert_close(
        triton_quant_gemm.linear(one_hot.to(DEVICE), weight, None).cpu(), dense[:, :3].t()
    )


def test_float8_fallback_matches_the_dequantized_weight() -> None:
    """The PyTorch fallback (no Triton, or a device without it) runs float8 weights too."""
    q = torch.randn(16, 32).to(torch.float8_e4m3fn).view(torch.uint8)
    canon = build(q, torch.zeros(32, dtype=torch.int64), torch.ones(1, 16), None, QTYPE_FP8)
    x = torch.randn(3, 32)
    got = kernels.linear(x, canon, None)
    torch.testing.assert_close(got, x @ canon.dequantize_original().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "k"), [(24, 96), (40, 70)])  # 70: the last group is 6 columns
def test_triton_round_to_nearest_int4_matches_its_dequantized_weight(n: int, k: int) -> None:
    """`--quantization int4`'s codes (quantization/int4.py): fractional zero points (-min / scale), which
    GPTQ's integer zeros never exercise."""
    from asyncengine.cuda import triton_quant_gemm
    from asyncengine.quantization.int4 import quantize_groups

    gen = torch.Generator().manual_seed(2)
    codes = quantize_groups(torch.randn(n, k, generator=gen) * 0.1 + 0.02)
    assert not torch.equal(codes.zeros, codes.zeros.round())
    canon = build(codes.codes, torch.arange(k) // codes.group_size, codes.scales, codes.zeros, QTYPE_U4)
    args = (canon.q, canon.scales, canon.zeros, canon.perm, canon.in_features, canon.group_size, canon.qtype)
    weight = triton_quant_gemm.pack(*args, torch.device(DEVICE))
    assert weight is not None
    torch.testing.assert_close(canon.dequantize_original(), codes.dequantize(), rtol=0, atol=1e-6)
    x, bias = torch.randn(7, k, generator=gen), torch.randn(n, generator=gen)
    got = triton_quant_gemm.linear(x.to(DEVICE), weight, bias.to(DEVICE)).cpu()
    torch.testing.assert_close(got, x @ codes.dequantize().t() + bias, rtol=1e-5, atol=1e-4)
