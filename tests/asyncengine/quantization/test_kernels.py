"""The fused CPU kernel (AVX-512 and portable builds) and the PyTorch fallback against the dequantized
weight, for every code type, with act-order permutations, partial groups and blocks, and M from a
decode step's to a prefill chunk's."""

from __future__ import annotations

import pytest
import torch
from torch_threads import outputs_with_threads

from asyncengine.cpu import amx as cpu_amx
from asyncengine.cpu import quant_gemm
from asyncengine.quantization import kernels
from asyncengine.quantization.canonical import QTYPE_FP8, QTYPE_U4, QTYPE_U8, Canonical, build

pytestmark = pytest.mark.skipif(not quant_gemm.available(), reason="no C compiler")


def random_layer(qtype: int, n: int, k: int, group: int, act_order: bool, seed: int = 0) -> Canonical:
    gen = torch.Generator().manual_seed(seed)
    groups = torch.arange(k) // group
    if act_order:
        groups = groups[torch.randperm(k, generator=gen)]
    count = int(groups.max()) + 1
    scales = torch.rand(count, n, generator=gen) * 0.05 + 0.01
    if qtype == QTYPE_FP8:
        q = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn).view(torch.uint8)
        return build(q, groups, scales, None, qtype)
    top = 16 if qtype == QTYPE_U4 else 256
    q = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, top, (count, n), generator=gen).float()
    return build(q, groups, scales, zeros, qtype)


CASES = [
    (QTYPE_U4, 40, 96, 64, False),  # partial last group, partial last 16-row block
    (QTYPE_U4, 64, 128, 32, True),  # act-order
    (QTYPE_U8, 33, 72, 72, False),  # per channel
    (QTYPE_U8, 48, 128, 32, True),
    (QTYPE_FP8, 50, 80, 80, False),  # one scale per row (per tensor / per channel)
    (QTYPE_FP8, 32, 96, 32, False),  # block scales
]


@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
@pytest.mark.parametrize(("qtype", "n", "k", "group", "act_order"), CASES)
@pytest.mark.parametrize("m", [1, 5, 8, 9, 64, 200, 300])  # <= 8: registers; then strips; 256 on: streamed
def test_kernel_matches_the_dequantized_weight(portable, qtype, n, k, group, act_order, m) -> None:
    if not quant_gemm.available(portable):
        pytest.skip("no C compiler")
    canon = random_layer(qtype, n, k, group, act_order)
    weight = quant_gemm.pack(*canon_args(canon), portable=portable, int8_activations=False)
    dense = canon.dequantize_original()  # [N, K] float32
    x = torch.randn(m, k)
    bias = torch.randn(n)
    expected = x @ dense.t() + bias
    got = quant_gemm.linear(x, weight, bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    # bfloat16 activations are widened exactly; the result is rounded once. Prefill-sized batches on AMX
    # multiply the dequantized weight rounded to bfloat16, what a bfloat16 copy of it holds
    xb, bb = x.bfloat16(), bias.bfloat16()
    on_amx = m >= quant_gemm.AMX_MIN_ROWS and quant_gemm.uses_amx(weight, torch.bfloat16)
    expected_b = xb.float() @ (dense.bfloat16().float() if on_amx else dense).t() + bb.float()
    got_b = quant_gemm.linear(xb, weight, bb)
    assert got_b.dtype == torch.bfloat16
    torch.testing.assert_close(got_b.float(), expected_b, rtol=8e-3, atol=8e-3)


needs_amx = pytest.mark.skipif(not cpu_amx.available(), reason="no AMX")


@needs_amx
@pytest.mark.parametrize(("qtype", "n", "k", "group", "act_order"), [c for c in CASES if c[0] != QTYPE_FP8])
@pytest.mark.parametrize("m", [32, 45, 300])  # a partial row tile; row blocks of 256
def test_amx_rows_multiply_the_bfloat16_weight(qtype, n, k, group, act_order, m) -> None:
    """From AMX_MIN_ROWS rows on, bfloat16 activations go to AMX tiles of the dequantized weight rounded to
    bfloat16: against that weight in float64, only the output's rounding (and float32 sums) differ. Groups
    padded to whole steps and act-order permutations read the activations in the codes' order."""
    canon = random_layer(qtype, n, k, group, act_order)
    for int8_activations in (False, True):  # the AMX path takes either packing
        weight = quant_gemm.pack(*canon_args(canon), int8_activations=int8_activations)
        if weight.k_int % 32:
            pytest.skip(f"K_int {weight.k_int} is not whole AMX tiles: the VNNI kernel keeps it")
        assert quant_gemm.uses_amx(weight, torch.bfloat16)
        assert not quant_gemm.uses_amx(weight, torch.float32)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        bias = torch.randn(n).bfloat16()
        want = x.double() @ canon.dequantize_original().bfloat16().double().t() + bias.double()
        got = quant_gemm.linear(x, weight, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=4e-3, atol=4e-3)


@needs_amx
@pytest.mark.parametrize("m", [40, 600])  # one item a thread; row blocks cut into items that change hands
def test_amx_rows_are_the_same_with_any_number_of_threads(m: int) -> None:
    """Threads own shares of the output groups and take over each other's items when theirs run out
    (amx_gemm.c's Shares): every output is still summed in one order, so 1, 2, 3 and 7 threads agree bit
    for bit."""
    canon = random_layer(QTYPE_U4, 1000, 256, 64, True)
    weight = quant_gemm.pack(*canon_args(canon))
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
    outs = outputs_with_threads(lambda: quant_gemm.linear(x, weight, None))
    want = x.double() @ canon.dequantize_original().bfloat16().double().t()
    torch.testing.assert_close(outs[0].double(), want, rtol=4e-3, atol=4e-3)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@needs_amx
def test_amx_rows_do_not_depend_on_the_batch_past_the_threshold() -> None:
    """Within the AMX regime a row's output is summed in one fixed order: any batch of AMX_MIN_ROWS rows or
    more gives it bit for bit (row blocks, partial tiles); below it the VNNI kernel decides."""
    canon = random_layer(QTYPE_U4, 80, 128, 32, True)
    weight = quant_gemm.pack(*canon_args(canon))
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    full = quant_gemm.linear(x, weight, None)
    for lo, hi in ((0, 32), (7, 40), (250, 300), (1, 299)):
        assert torch.equal(quant_gemm.linear(x[lo:hi], weight, None), full[lo:hi]), (lo, hi)


def canon_args(canon: Canonical) -> tuple:
    return (canon.q, canon.scales, canon.zeros, canon.perm, canon.in_features, canon.group_size, canon.qtype)


def int8_reference(x: torch.Tensor, weight: quant_gemm.QuantWeight, dense: torch.Tensor) -> torch.Tensor:
    """What the int8-activation path computes, written independently: the activations gathered into the
    kernel's column order, quantized per row and block (32 columns, or the largest divisor of the group
    that is whole steps and <= 32) to round(x * 127 / max|x|), then multiplied in float64."""
    k_int, gs = weight.k_int, weight.group_size
    unit = 8 if weight.qtype == QTYPE_U4 else 4
    qb = 32 if gs % 32 == 0 else max(d for d in range(unit, 33, unit) if gs % d == 0)
    cols = weight.perm if weight.perm is not None else torch.arange(k_int)
    cols = torch.where(cols < weight.in_features, cols, -1)
    xf = torch.cat([x.float(), x.new_zeros(x.shape[0], 1).float()], 1)[:, cols]  # [M, K_int], -1: the zero
    blocks = xf.view(x.shape[0], -1, qb)
    top = blocks.abs().amax(-1, keepdim=True)  # float32 throughout, as the kernel rounds
    inv = torch.where(top > 0, torch.full_like(top, 127) / top, 0)  # (127 / top would take 1 / top first)
    q = torch.round(blocks * inv)  # half to even
    xq = (q.double() * (top / 127).double()).view(x.shape[0], k_int)
    w_int = torch.cat([dense.double(), dense.new_zeros(dense.shape[0], 1).double()], 1)[:, cols]
    return xq @ w_int.t()


@pytest.mark.skipif(not quant_gemm.native_int8(), reason="no AVX512-VNNI")
@pytest.mark.parametrize(("qtype", "n", "k", "group", "act_order"), [c for c in CASES if c[0] != QTYPE_FP8])
# <= 2: three-block tiles; larger: four-row tiles (31: below AMX_MIN_ROWS, where an AMX CPU takes over)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 31])
def test_int8_activations_match_their_reference(qtype, n, k, group, act_order, m) -> None:
    canon = random_layer(qtype, n, k, group, act_order)
    weight = quant_gemm.pack(*canon_args(canon), int8_activations=True)
    assert weight.int8_activations
    dense = canon.dequantize_original()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    bias = torch.randn(n).bfloat16()
    got = quant_gemm.linear(x, weight, bias).double()
    want = int8_reference(x, weight, dense) + bias.double()
    # only the output's rounding to bfloat16 (and float32 sums) differ from the reference
    torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3)
    # and the activations' rounding is visible: the exact path is a different result
    exact = quant_gemm.linear(x, quant_gemm.pack(*canon_args(canon), int8_activations=False), bias).double()
    assert (exact - got).abs().max() > 1e-2
    # float32 activations are never quantized
    x32 = x.float()
    torch.testing.assert_close(quant_gemm.linear(x32, weight, None), x32 @ dense.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not quant_gemm.native_int8(), reason="no AVX512-VNNI")
def test_int8_activations_on_odd_groups_and_padding() -> None:
    """Groups that are not whole steps are padded (18 -> 24 columns of 4-bit codes), a per-channel
    group of 102 8-bit columns takes 8-column activation blocks, K past the last group reads zero."""
    for qtype, n, k, group in ((QTYPE_U4, 40, 100, 18), (QTYPE_U8, 24, 102, 102)):
        canon = random_layer(qtype, n, k, group, False)
        weight = quant_gemm.pack(*canon_args(canon), int8_activations=True)
        assert weight.group_size % (8 if qtype == QTYPE_U4 else 4) == 0
        x = torch.randn(3, k).bfloat16()
        want = int8_reference(x, weight, canon.dequantize_original())
        torch.testing.assert_close(quant_gemm.linear(x, weight, None).double(), want, rtol=8e-3, atol=8e-3)


def test_int8_activations_follow_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    canon = random_layer(QTYPE_U4, 32, 64, 32, False)
    assert quant_gemm.pack(*canon_args(canon)).int8_activations == quant_gemm.native_int8()
    monkeypatch.setenv("ASYNCENGINE_CPU_INT8_ACTIVATIONS", "0")
    assert not quant_gemm.native_int8()
    assert not quant_gemm.pack(*canon_args(canon)).int8_activations
    fp8 = random_layer(QTYPE_FP8, 32, 64, 32, False)
    assert not quant_gemm.pack(*canon_args(fp8), int8_activations=True).int8_activations  # no integer path


@pytest.mark.parametrize("int8_activations", [False, True], ids=["exact", "int8act"])
@pytest.mark.parametrize("qtype", [QTYPE_U4, QTYPE_U8, QTYPE_FP8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch(qtype: int, dtype: torch.dtype, int8_activations: bool) -> None:
    """A row's output is summed in one fixed order, whatever M is: decode and prefill agree bit for bit
    (bfloat16: M <= 4 runs three-block tiles, larger M one block at a time; 80 rows: a partial tile;
    int8 activations: M <= 2 three-block tiles, larger M four-row tiles two blocks wide)."""
    canon = random_layer(qtype, 80, 128, 32, True)
    weight = quant_gemm.pack(*canon_args(canon), int8_activations=int8_activations)
    # 40 rows: past AMX_MIN_ROWS, which an AMX CPU runs on its tiles (the test below)
    rows = 40 if not quant_gemm.uses_amx(weight, dtype) else quant_gemm.AMX_MIN_ROWS - 1
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    full = quant_gemm.linear(x, weight, None)
    for i in (0, 7, rows - 1):
        assert torch.equal(quant_gemm.linear(x[i : i + 1], weight, None), full[i : i + 1])
    assert torch.equal(quant_gemm.linear(x[:3], weight, None), full[:3])


def test_strided_rows_and_threads() -> None:
    canon = random_layer(QTYPE_U8, 256, 512, 128, False)
    weight = quant_gemm.pack(*canon_args(canon))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 1024, generator=gen)[:, ::2]  # rows 1024 apart, columns strided: copied first
    wide = torch.randn(16, 600, generator=gen)[:, :512]  # rows 600 apart, contiguous columns
    dense = canon.dequantize_original()
    # against float64, with a float32 sum's error over 512 terms (atol 1e-4 against a float32 reference
    # failed now and then: both sides round)
    for inp in (x, wide):
        torch.testing.assert_close(
            quant_gemm.linear(inp, weight, None).double(),
            inp.double() @ dense.double().t(),
            rtol=1e-5,
            atol=5e-4,
        )


def test_fallback_and_canonical_layout() -> None:
    canon = random_layer(QTYPE_U4, 40, 96, 32, True)
    assert canon.perm is not None and canon.q.shape[1] % canon.group_size == 0
    x = torch.randn(3, 96)
    dense = canon.dequantize_original()
    assert_sums_close(kernels.linear(x, canon, None), x, dense)  # PyTorch path
    packed = kernels.prepare(canon, torch.device("cpu"))
    assert isinstance(packed, quant_gemm.QuantWeight)
    assert_sums_close(kernels.linear(x, packed, None), x, dense)
    regular = random_layer(QTYPE_U4, 16, 128, 32, False)
    assert regular.perm is None and regular.q.shape == (16, 128)  # aligned groups: no permutation


def test_a_shard_holding_parts_of_groups_pads_each_group() -> None:
    """A row-parallel shard of an act-order layer holds some columns of many groups: each group's columns
    are gathered and padded to one length, padding codes meeting zero activations."""
    gen = torch.Generator().manual_seed(3)
    full_groups = (torch.arange(128) // 32)[torch.randperm(128, generator=gen)]
    shard = full_groups[64:]  # rank 1 of 2
    q = torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.uint8)
    scales = torch.rand(4, 16, generator=gen) + 0.1
    zeros = torch.randint(0, 16, (4, 16), generator=gen).float()
    canon = build(q, shard, scales, zeros, QTYPE_U4)
    counts = torch.bincount(shard, minlength=4)
    assert canon.group_size == int(counts.max()) + int(counts.max()) % 2
    assert canon.q.shape[1] == canon.group_size * int((counts > 0).sum())
    dense = (q.float() - zeros[shard].t()) * scales[shard].t()
    torch.testing.assert_close(canon.dequantize_original(), dense)
    x = torch.randn(2, 64, generator=gen)
    weight = quant_gemm.pack(*canon_args(canon))
    assert_sums_close(quant_gemm.linear(x, weight, None), x, dense)


def assert_sums_close(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """got == x @ dense^T up to float32 sums taken in another order: the bound scales with the sum of
    |products| (an output near zero is a cancellation of large terms, not a small sum; a fixed atol
    failed on such an output now and then)."""
    bound = 1e-5 * float((x.abs() @ dense.abs().t()).max())
    want = (x.double() @ dense.double().t()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=bound)
