"""The AMX bfloat16 GEMM (cpu/amx.py, csrc/amx_gemm.c) against a float64 reference: every row-count
regime (one tile, 32-row chunks, a partial last tile, several 256-row blocks), ragged N, K padded to 32,
bias, strided input; a row's result does not depend on its batch; NaN stays in its row."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from torch_threads import outputs_with_threads

from asyncengine.cpu import amx as cpu_amx
from asyncengine.cpu import gemm as cpu_gemm
from asyncengine.cpu import ops as cpu_ops
from asyncengine.cpu.build import build_library
from asyncengine.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncengine.layers.parallel import ParallelContext

needs_amx = pytest.mark.skipif(not cpu_amx.available(), reason="no AMX-BF16 on this CPU (or no compiler)")
ROWS = [1, 3, 15, 16, 17, 31, 32, 33, 48, 64, 65, 100, 255, 256, 257, 530]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within two bfloat16 rounding steps of the exact result (float32 sums, one rounding at the end)."""
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs()
    tol = ref.abs() * 2**-7 + ref.abs().max() * 2**-12
    assert bool((err <= tol).all()), f"max error {err.max().item():.3g} (tolerance {tol.max().item():.3g})"


@needs_amx
@pytest.mark.parametrize("k,n", [(32, 1), (64, 100), (48, 17), (768, 768), (96, 4100)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(k * 7 + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    packed = cpu_amx.pack(w)
    assert packed is not None and packed.in_padded % 32 == 0 and packed.in_padded >= k
    for m in ROWS:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        out = cpu_amx.linear(x, packed, b)
        assert out.shape == (m, n)
        assert_bf16_close(out, reference(x, w, b))


@needs_amx
@pytest.mark.parametrize("n", [200, 512])  # 512: whole staged rows, which large M streams out (non-temporal)
def test_a_row_is_the_same_in_any_batch(n: int) -> None:
    """Each output element is summed in one order whatever M is: rows alone, in a small batch (one tile) and
    in large ones (chunks, a partial tile, row blocks) agree bit for bit; bias too."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = cpu_amx.pack(w)
    x = torch.randn(300, 256, generator=g).to(torch.bfloat16)
    full = cpu_amx.linear(x, packed, b)
    for m in (1, 7, 16, 40, 64, 299):
        assert torch.equal(cpu_amx.linear(x[:m], packed, b), full[:m]), m
    assert torch.equal(cpu_amx.linear(x[123:124], packed, b), full[123:124])


@needs_amx
@pytest.mark.parametrize("m", [5, 40, 300, 600])  # one row tile; chunks; the large-M path's row blocks
def test_any_number_of_threads_gives_the_same_bits(m: int) -> None:
    """Threads own shares of the output blocks and take over each other's items when their own run out
    (amx_gemm.c's Shares): whichever thread computes an output, it is summed in the same order, so 1, 2, 3
    and 7 threads (more than this machine's cores: items change hands) agree bit for bit."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1000, 320, generator=g).to(torch.bfloat16)  # 63 output blocks: shares of unequal size
    b = torch.randn(1000, generator=g).to(torch.bfloat16)
    packed = cpu_amx.pack(w)
    x = torch.randn(m, 320, generator=g).to(torch.bfloat16)
    outs = outputs_with_threads(lambda: cpu_amx.linear(x, packed, b))
    assert_bf16_close(outs[0], reference(x, w, b))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@needs_amx
def test_nan_stays_in_its_row_and_strided_rows() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    packed = cpu_amx.pack(w)
    wide = torch.randn(70, 200, generator=g).to(torch.bfloat16)
    x = wide[:, :128]  # rows 200 apart: the kernel takes the row stride as it is
    assert x.stride(0) == 200
    clean = cpu_amx.linear(x, packed, None)
    assert_bf16_close(clean, reference(x, w, None))
    x = x.clone()
    x[69, 5] = float("nan")  # in the partial last tile
    x[3, 0] = float("inf")
    out = cpu_amx.linear(x, packed, None)
    assert out[69].isnan().all() and not out[3].isfinite().all()
    rest = [i for i in range(70) if i not in (3, 69)]
    assert torch.equal(out[rest], clean[rest])


@needs_amx
def test_leading_dims_and_dtype_check() -> None:
    w = torch.randn(48, 64).to(torch.bfloat16)
    packed = cpu_amx.pack(w)
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    out = cpu_amx.linear(x, packed, None)
    assert out.shape == (2, 5, 48)
    assert_bf16_close(out.reshape(10, 48), reference(x.reshape(10, 64), w, None))
    with pytest.raises(TypeError, match="bfloat16"):
        cpu_amx.linear(x.float(), packed, None)
    assert cpu_amx.pack(w.float()) is None and cpu_amx.pack(torch.randn(4, dtype=torch.bfloat16)) is None


@needs_amx
@pytest.mark.parametrize("layer_cls,bias", [(ColumnParallelLinear, True), (RowParallelLinear, False)])
def test_layers_pack_bfloat16_into_amx_tiles(layer_cls, bias) -> None:
    layer = layer_cls(96, 80, ParallelContext(), bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if layer.bias is not None:
            layer.bias.normal_()
    w, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    assert layer.prepack() and isinstance(layer.packed, cpu_amx.AmxWeight)
    assert layer.weight.numel() == 0  # one copy of the weight, the tiles
    x = torch.randn(9, 96).to(torch.bfloat16)
    assert_bf16_close(layer(x), reference(x, w, b))
    assert isinstance(cpu_gemm.prepack(torch.randn(64, 64)), torch.Tensor | type(None))  # float32: never AMX


def test_without_amx_the_build_says_so() -> None:
    """A build without AMX (here: the portable flags) compiles stubs that report it; callers keep oneDNN."""
    lib = build_library(cpu_amx.SOURCE, portable=True)
    if lib is None:
        pytest.skip("no C compiler")
    lib.amx_available.restype = ctypes.c_int
    assert lib.amx_available() == 0


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCENGINE_CPU_AMX", "0")
    cpu_amx.load_library.cache_clear()
    try:
        assert not cpu_amx.available()
        assert cpu_amx.pack(torch.randn(32, 32).to(torch.bfloat16)) is None
        packed = cpu_gemm.prepack(torch.randn(32, 32).to(torch.bfloat16))
        # the bfloat16 blocks of the quantized kernel where the CPU has AVX512-BF16, else oneDNN
        assert packed is None or isinstance(packed, torch.Tensor | cpu_gemm.QuantWeight)
        assert not isinstance(packed, cpu_amx.AmxWeight)
    finally:
        monkeypatch.delenv("ASYNCENGINE_CPU_AMX")
        cpu_amx.load_library.cache_clear()


@needs_amx
def test_padded_k_matches_f_linear() -> None:
    """K = 40 pads to 64 with zero weight columns and zero activation columns: the same as F.linear."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(33, 40, generator=g).to(torch.bfloat16)
    packed = cpu_amx.pack(w)
    assert packed is not None and (packed.in_features, packed.in_padded) == (40, 64)
    x = torch.randn(20, 40, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(
        cpu_amx.linear(x, packed, None).float(), F.linear(x, w).float(), rtol=2**-7, atol=1e-2
    )


@needs_amx
@pytest.mark.parametrize("k,inter", [(64, 16), (96, 48), (40, 32), (768, 2048)])
def test_gated_weight_gives_silu_and_mul_bit_for_bit(k: int, inter: int) -> None:
    """A [gate | up] weight packed gated: the GEMM's epilogue equals cpu_ops.silu_and_mul on the plain GEMM
    output, bit for bit, in every row regime (one tile, chunks, the K-blocked path with its staging)."""
    g = torch.Generator().manual_seed(k + inter)
    w = (torch.randn(2 * inter, k, generator=g) * 0.3).to(torch.bfloat16)
    b = torch.randn(2 * inter, generator=g).to(torch.bfloat16)
    plain, gated = cpu_amx.pack(w), cpu_amx.pack(w, gated=True)
    assert gated is not None and gated.gated
    for m in ROWS:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for bias in (None, b):
            expected = cpu_ops.silu_and_mul(cpu_amx.linear(x, plain, bias))
            assert torch.equal(cpu_amx.linear(x, gated, bias), expected), (m, bias is None)
    assert cpu_amx.pack(torch.randn(2 * 24, 64).to(torch.bfloat16), gated=True) is None  # inter not of 16


@needs_amx
def test_gated_weight_keeps_denormals() -> None:
    """Its roundings are torch's: a denormal silu(gate) * up is kept, as cpu_ops.silu_and_mul keeps it."""
    from test_gated_weights import denormal_gate

    w, x, bias = denormal_gate(64, 32, torch.bfloat16)
    plain, gated = cpu_amx.pack(w), cpu_amx.pack(w, gated=True)
    assert plain is not None and gated is not None
    got, expected = cpu_amx.linear(x, gated, bias), cpu_ops.silu_and_mul(cpu_amx.linear(x, plain, bias))
    assert (got != 0).all() and torch.equal(got.view(torch.int16), expected.view(torch.int16))


@needs_amx
def test_gated_mlp_packs_its_gate_up() -> None:
    """LlamaMLP.prepack fuses SiLU-and-mul into gate_up's GEMM; the layer's own prepack then keeps it."""
    from types import SimpleNamespace

    from asyncengine.models.llama import LlamaMLP, LlamaOptions

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="silu")
    mlp = LlamaMLP(cfg, ParallelContext(), LlamaOptions()).to(torch.bfloat16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        expected = mlp(x)
        assert cpu_gemm.prepack_model(mlp) > 0 and mlp.fused_act
        assert mlp.gate_up_proj.packed.gated and mlp.gate_up_proj.weight.numel() == 0
        got = mlp(x)
    assert_bf16_close(got, expected.double())
