"""Packing round trips against the reference tools' own loops (quant_writer.py), for every format and bit
width, with shapes that are not multiples of the pack factor or of the group size."""

from __future__ import annotations

import pytest
import torch
from quant_writer import AWQ_ORDER_MAP, autoawq_pack, autogptq_pack, ct_pack_to_int32

from asyncengine.quantization.packing import AWQ_ORDER, pack_int32, unpack_int32


def codes(shape: tuple[int, ...], bits: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2**bits, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_layout_round_trips(bits: int, v1: bool) -> None:
    k, n, groups = 96, 40, 3  # 96 = 1.5 groups of 64: a partial last group
    q, zeros = codes((n, k), bits), codes((groups, n), bits, seed=1)
    zeros[0, :5] = 0  # v1 stores zero - 1: a zero of 0 wraps to 2**bits - 1
    qweight, qzeros = autogptq_pack(q, zeros, bits, v1)
    assert qweight.shape == (k * bits // 32, n) and qzeros.shape == (groups, n * bits // 32)
    assert torch.equal(pack_int32(q.t(), bits, dim=0), torch.from_numpy(qweight))
    assert torch.equal(unpack_int32(torch.from_numpy(qweight), bits, 0, k).t().int(), q)
    stored = unpack_int32(torch.from_numpy(qzeros), bits, 1, n).int()
    if v1:
        assert int(stored[0, 0]) == 2**bits - 1
        stored = (stored + 1) & (2**bits - 1)
    assert torch.equal(stored, zeros)


def test_awq_layout_round_trips_in_its_interleaved_order() -> None:
    assert list(AWQ_ORDER) == AWQ_ORDER_MAP
    k, n, groups = 72, 48, 3
    q, zeros = codes((n, k), 4), codes((groups, n), 4, seed=1)
    qweight, qzeros = autoawq_pack(q, zeros)
    assert torch.equal(pack_int32(q.t(), 4, dim=1, order=AWQ_ORDER), torch.from_numpy(qweight))
    assert torch.equal(unpack_int32(torch.from_numpy(qweight), 4, 1, n, AWQ_ORDER).t().int(), q)
    assert torch.equal(unpack_int32(torch.from_numpy(qzeros), 4, 1, n, AWQ_ORDER).int(), zeros)
    # the interleave is real: a plain sequential unpack reads other columns
    assert not torch.equal(unpack_int32(torch.from_numpy(qweight), 4, 1, n).t().int(), q)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [64, 70])  # 70: a partial last word, zero-padded
def test_compressed_tensors_layout_round_trips(bits: int, k: int) -> None:
    n = 24
    q = codes((n, k), bits)
    offset = 1 << (bits - 1)
    packed = torch.from_numpy(ct_pack_to_int32(q - offset, bits))  # the tool takes signed codes
    assert packed.shape == (n, -(-k * bits // 32))
    assert torch.equal(pack_int32(q, bits, dim=1), packed)
    assert torch.equal(unpack_int32(packed, bits, 1, k).int(), q)
    zp = codes((n, 3), bits, seed=2)  # zero points pack along the output dim
    packed_zp = torch.from_numpy(ct_pack_to_int32(zp - offset, bits, packed_dim=0))
    assert torch.equal(unpack_int32(packed_zp, bits, 0, n).int(), zp)


def test_unpack_rejects_too_few_words() -> None:
    with pytest.raises(ValueError, match="expected"):
        unpack_int32(torch.zeros(2, 3, dtype=torch.int32), 4, 0, 17)
