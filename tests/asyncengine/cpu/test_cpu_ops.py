"""The fused CPU ops (csrc/cpu_ops.c) against the PyTorch code they replace, in both builds."""

from __future__ import annotations

import pytest
import torch

from asyncengine.cpu import ops as cpu_ops
from asyncengine.layers.activation import ActAndMul, gelu_new
from asyncengine.layers.norm import LayerNorm, RMSNorm
from asyncengine.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(cpu_ops.load_ops_library() is None, reason="no C compiler")


@pytest.fixture(params=[False, True], ids=["native", "portable"])
def build(request, monkeypatch):
    lib = cpu_ops.load_ops_library(portable=request.param)
    monkeypatch.setattr(cpu_ops, "load_ops_library", lambda portable=False: lib)


def torch_path(fn, *args):
    with cpu_ops.disabled():
        return fn(*args)


def check(got, ref, dtype) -> None:
    if dtype == torch.bfloat16:
        # the same rounding chain as torch: equal except where a float32 sum order flips a last bit
        assert (got != ref).float().mean().item() < 1e-3
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 100), (300, 768)])
def test_rms_norm(build, dtype, rows, hidden) -> None:
    torch.manual_seed(rows)
    norm = RMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(rows, 3 * hidden, dtype=dtype)[:, hidden : 2 * hidden]  # a strided view, like a qkv split
    residual = torch.randn(rows, hidden, dtype=dtype)
    # denormals, which the bfloat16 rounding instruction would flush to zero (the op keeps them, as torch)
    x[0, :3], residual[0, :3] = torch.tensor([1e-39, -3e-40, 1e-39]), torch.tensor([0.0, 0.0, 2e-39])
    ref, ref_res = torch_path(norm.fused_add, x, residual)
    got, got_res = norm.fused_add(x, residual)
    assert torch.equal(got_res, ref_res)
    check(got, ref, dtype)
    check(norm(x), torch_path(norm, x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 16, 128), (37, 4, 64), (5, 3, 40)])
def test_rms_norm_per_head(build, dtype, tokens, heads, head_dim) -> None:
    """Qwen3's q_norm / k_norm: each head of a strided qkv slice normalised on its own, in one call."""
    torch.manual_seed(heads)
    norm = RMSNorm(head_dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    width = heads * head_dim
    x = torch.randn(tokens, 3 * width, dtype=dtype)[:, width : 2 * width] * 5  # a column slice of qkv
    got = norm.per_head(x, head_dim)
    assert got.shape == (tokens, width)
    ref = torch_path(norm, x.unflatten(-1, (heads, head_dim))).flatten(1)
    check(got, ref, dtype)
    assert torch.equal(torch_path(norm.per_head, x, head_dim), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 40), (64, 2048), (3, 100)])
def test_silu_and_mul(build, dtype, rows, inter) -> None:
    act = ActAndMul("silu")
    x = torch.randn(rows, 2 * inter, dtype=dtype) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating exponentials
    check(act(x), torch_path(act, x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 100), (300, 768)])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(build, dtype, rows, hidden, bias) -> None:
    torch.manual_seed(rows)
    norm = LayerNorm(hidden, eps=1e-5, bias=bias).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        if norm.bias is not None:
            norm.bias.normal_()
    x = torch.randn(rows, 3 * hidden, dtype=dtype)[:, hidden : 2 * hidden] * 3 + 1  # strided, off-centre
    residual = torch.randn(rows, hidden, dtype=dtype)
    x[0, :3], residual[0, :3] = torch.tensor([1e-39, -3e-40, 1e-39]), torch.tensor([0.0, 0.0, 2e-39])
    ref, ref_res = torch_path(norm.fused_add, x, residual)
    got, got_res = norm.fused_add(x, residual)
    assert torch.equal(got_res, ref_res)  # x + residual rounded as torch's add
    check(got, ref, dtype)
    check(norm(x), torch_path(norm, x), dtype)
    # the torch path is nn.LayerNorm's
    torch.testing.assert_close(
        torch_path(norm, x), torch.nn.functional.layer_norm(x, (hidden,), norm.weight, norm.bias, 1e-5)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 40), (64, 3072), (3, 7, 100)])
def test_gelu_new(build, dtype, shape) -> None:
    """HF's NewGELUActivation: bfloat16 bit for bit (the same rounding chain, pow's square rounded too);
    float32 to tanh's last bit. Saturation, zeros, denormals, infinities and NaN as torch."""
    x = torch.randn(shape, dtype=dtype) * 4
    x.view(-1)[:8] = torch.tensor(
        [-100.0, 100.0, 0.0, -0.0, 1e-39, float("inf"), float("-inf"), float("nan")]
    )
    got, ref = gelu_new(x), torch_path(gelu_new, x)
    assert got.shape == ref.shape and got.dtype == dtype
    assert torch.equal(got.isnan(), ref.isnan())  # NaN stays NaN (its sign and payload aside)
    if dtype == torch.bfloat16:
        assert torch.equal(got.nan_to_num().view(torch.int16), ref.nan_to_num().view(torch.int16))
    else:
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,half", [(64, 32), (80, 16), (128, 64)])  # (80, 16): partial rotary
def test_rotary(build, dtype, head_dim, half) -> None:
    rows, heads = 9, 3
    x = torch.randn(rows, 2 * heads * head_dim, dtype=dtype)[:, : heads * head_dim]
    cos, sin = torch.randn(rows, half, dtype=dtype), torch.randn(rows, half, dtype=dtype)
    got = apply_rotary(x, cos, sin, head_dim)
    ref = torch_path(apply_rotary, x, cos, sin, head_dim)
    assert torch.equal(got, ref)  # products and sums in torch's order: bit for bit


def test_other_dtypes_and_devices_fall_back() -> None:
    assert cpu_ops.silu_and_mul(torch.randn(2, 8, dtype=torch.float16)) is None
    assert cpu_ops.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(dtype) -> None:
    """k / v as column slices of a fused qkv output (row stride > row width), as the models pass them."""
    torch.manual_seed(0)
    tokens, heads, kv_heads, head_dim, blocks, bs = 9, 4, 2, 16, 6, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * bs)[:tokens]
    got_k, got_v = (
        torch.zeros(blocks, bs, kv_heads, head_dim, dtype=dtype),
        torch.zeros(blocks, bs, kv_heads, head_dim, dtype=dtype),
    )
    assert cpu_ops.write_kv(k, v, got_k, got_v, slots)
    ref_k, ref_v = torch.zeros_like(got_k), torch.zeros_like(got_v)
    ref_k.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    ref_v.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
    with pytest.raises(IndexError):
        cpu_ops.write_kv(k, v, got_k, got_v, torch.full((tokens,), blocks * bs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,half", [(9, 4, 2, 64, 32), (5, 3, 3, 80, 16), (300, 12, 12, 64, 32)]
)
def test_rope_write_kv_matches_rotary_then_write(
    build, dtype, tokens, heads, kv_heads, head_dim, half
) -> None:
    """One call == rotary(q), rotary(k), write_kv(rotated k, v), bit for bit: GQA, partial rotary (80, 16),
    q / k / v as column slices of the fused qkv output, a multi-threaded row count (300)."""
    torch.manual_seed(tokens)
    blocks, bs = 80, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    cos, sin = torch.randn(tokens, half, dtype=dtype), torch.randn(tokens, half, dtype=dtype)
    slots = torch.randperm(blocks * bs)[:tokens]
    shape = (blocks, bs, kv_heads, head_dim)
    got_k, got_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    fused = cpu_ops.rope_write_kv(q, k, v, cos, sin, got_k, got_v, slots, head_dim)
    assert fused is not None
    ref_q, ref_k = apply_rotary(q, cos, sin, head_dim), apply_rotary(k, cos, sin, head_dim)
    ref_kc, ref_vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    assert cpu_ops.write_kv(
        ref_k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim), ref_kc, ref_vc, slots
    )
    assert torch.equal(fused[0], ref_q) and torch.equal(fused[1], ref_k)
    assert torch.equal(got_k, ref_kc) and torch.equal(got_v, ref_vc)
    with pytest.raises(IndexError):
        cpu_ops.rope_write_kv(q, k, v, cos, sin, got_k, got_v, torch.full((tokens,), blocks * bs), head_dim)
    # what it does not take: a cache of another dtype (float8), int32 slots
    assert (
        cpu_ops.rope_write_kv(
            q, k, v, cos, sin, got_k.to(torch.float8_e5m2), got_v.to(torch.float8_e5m2), slots, head_dim
        )
        is None
    )
    assert cpu_ops.rope_write_kv(q, k, v, cos, sin, got_k, got_v, slots.int(), head_dim) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows(build, dtype) -> None:
    """The first index of each row's maximum, or of its first NaN, exactly as torch's max(dim).indices:
    ties, +-inf, rows of -inf only, NaN, a strided row view (the LM head's vocab padding), odd widths."""
    torch.manual_seed(0)
    for trial in range(120):
        rows, cols = 1 + trial % 9, 1 + (trial * 37) % 301
        x = (torch.randn(rows, cols) * 2).round().to(dtype)  # coarse values: many ties
        if trial % 5 == 0:
            x[0, (trial * 7) % cols] = float("nan")
        if trial % 7 == 0:
            x[-1] = float("-inf")
        if trial % 11 == 0:
            x[0, -1] = float("inf")
        got = cpu_ops.argmax_rows(x)
        assert got is not None and torch.equal(got, x.max(dim=-1).indices), (trial, x)
    wide = torch.randn(6, 1040).to(dtype)
    view = wide[:, :1000]  # rows 1040 apart
    assert torch.equal(cpu_ops.argmax_rows(view), view.max(dim=-1).indices)
    with cpu_ops.disabled():
        assert cpu_ops.argmax_rows(wide) is None


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16])
def test_gather_rows_is_index_then_convert(src: torch.dtype, dst: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    table = (torch.randn(50, 24, generator=gen) * 100).to(src)
    table[3, 5] = float("nan")
    idx = torch.tensor([3, 0, 49, 3, 17], dtype=torch.int64)
    got = cpu_ops.gather_rows(table, idx, dst)
    assert got is not None and got.dtype == dst
    want = table[idx].to(dst)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)) and got[0, 5].isnan()
    assert cpu_ops.gather_rows(table, idx.int(), dst) is None  # int32 ids: torch's path
    with pytest.raises(IndexError, match="1 id"):
        cpu_ops.gather_rows(table, torch.tensor([0, 50]), dst)
    with pytest.raises(IndexError):
        cpu_ops.gather_rows(table, torch.tensor([-1]), dst)
