"""Wire types: round trips, and decoders that only ever raise typed msgspec errors on garbage."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.transport.codec import engine_codec, worker_codec
from asyncengine.transport.wire import (
    CachedSeq,
    ExecuteModelRequest,
    InitCache,
    ModelOutput,
    NewSeq,
    SamplingOptions,
    Shutdown,
    TokenLogprobs,
    WorkerFailure,
    pack_ids,
    unpack_ids,
)


def sample_step() -> ExecuteModelRequest:
    return ExecuteModelRequest(
        step_id=7,
        new_seqs=[
            NewSeq(1, pack_ids(list(range(300))), 300, [4, 5], 0, 300, SamplingOptions(temperature=0.0))
        ],
        cached_seqs=[CachedSeq(2, 1, [42], [9])],
        finished_seq_ids=[3],
    )


def test_round_trips() -> None:
    ec, wc = engine_codec(), worker_codec()
    for msg in (sample_step(), InitCache(12), Shutdown()):
        assert ec.decode(ec.encode(msg)) == msg
    out = ModelOutput(7, pack_ids([1, 2]), [TokenLogprobs([1, 5], [-0.1, -2.0], [1, 2]), None])
    assert wc.decode(wc.encode(out)) == out
    assert wc.decode(wc.encode(WorkerFailure(0, "boom"))) == WorkerFailure(0, "boom")


@given(st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=500))
def test_pack_ids_round_trip(ids: list[int]) -> None:
    assert unpack_ids(pack_ids(ids)) == ids


def test_a_step_is_compact() -> None:
    # a decode step of 256 sequences: a few bytes per sequence, not hundreds
    step = ExecuteModelRequest(1, cached_seqs=[CachedSeq(i, 1, [i]) for i in range(256)])
    assert len(engine_codec().encode(step)) < 256 * 12


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decoders_reject_random_bytes_with_typed_errors(data: bytes) -> None:
    for codec in (engine_codec(), worker_codec()):
        try:
            codec.decode(data)
        except msgspec.MsgspecError:
            pass


@pytest.mark.parametrize("seed", range(5))
def test_mutated_real_messages_fail_typed(seed: int) -> None:
    rng = random.Random(seed)
    codec = engine_codec()
    real = bytearray(codec.encode(sample_step()))
    for _ in range(400):
        data = bytearray(real)
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            codec.decode(bytes(data))
        except msgspec.MsgspecError:
            pass
