"""asyncengine.layers.grammar_mask against a per-token reference: which logits become -inf, which rows
are touched, masks narrower or wider than the vocabulary, wire bytes, dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.layers.grammar_mask import apply_token_bitmask_, bitmask_from_bytes, unpack_bitmask
from asyncengine.structured_output import allocate_bitmask, allowed_token_ids


def random_bitmask(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 2**32, size=(rows, (vocab + 31) // 32), dtype=np.uint64)
        .astype(np.uint32)
        .view(np.int32)
    )


def reference(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """The obvious loop over tokens."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        for t in range(vocab):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[i, word]) >> (t % 32)) & 1
            if not allowed:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [4096, 4100, 31, 1])
def test_matches_the_per_token_loop(vocab: int) -> None:
    bitmask = random_bitmask(3, vocab)
    logits = torch.randn(5, vocab)
    expected = reference(logits, bitmask, [4, 0, 2])
    apply_token_bitmask_(logits, torch.from_numpy(bitmask), [4, 0, 2])
    assert torch.equal(logits, expected)  # allowed values exact, rows 1 and 3 untouched


def test_all_rows_when_rows_is_none() -> None:
    bitmask = random_bitmask(4, 300, seed=1)
    logits = torch.randn(4, 300)
    expected = reference(logits, bitmask, [0, 1, 2, 3])
    apply_token_bitmask_(logits, torch.from_numpy(bitmask))
    assert torch.equal(logits, expected)


def test_mask_narrower_than_logits_disallows_the_rest() -> None:
    """The model's embedding padded past the mask's bits (a mask sized to the tokenizer)."""
    bitmask = np.full((1, 2), -1, dtype=np.int32)  # 64 tokens, all allowed
    logits = torch.zeros(1, 100)
    apply_token_bitmask_(logits, torch.from_numpy(bitmask))
    assert torch.isfinite(logits[0, :64]).all() and torch.isinf(logits[0, 64:]).all()


def test_mask_wider_than_logits_is_cut() -> None:
    bitmask = allocate_bitmask(1, 4160)  # the masks padded, the logits not
    bitmask[0, 0] = 0b101
    logits = torch.zeros(1, 4096)
    apply_token_bitmask_(logits, torch.from_numpy(bitmask))
    assert torch.isfinite(logits[0, :3]).tolist() == [True, False, True]
    assert torch.isfinite(logits[0, 32:]).all()


def test_unpack_agrees_with_the_engine_side_reading() -> None:
    bitmask = random_bitmask(2, 1000, seed=3)
    allowed = unpack_bitmask(torch.from_numpy(bitmask), 1000)
    for i in range(2):
        assert torch.nonzero(allowed[i]).flatten().tolist() == allowed_token_ids(bitmask[i], 1000).tolist()


def test_wire_bytes_round_trip() -> None:
    bitmask = random_bitmask(3, 4096, seed=4)
    tensor = bitmask_from_bytes(bitmask.tobytes(), 3)
    assert tensor.dtype == torch.int32 and tensor.shape == (3, 128)
    assert np.array_equal(tensor.numpy(), bitmask)
    with pytest.raises(ValueError):
        bitmask_from_bytes(b"\0" * 10, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_keep_allowed_values(dtype: torch.dtype) -> None:
    bitmask = random_bitmask(2, 500, seed=5)
    logits = torch.randn(2, 500).to(dtype)
    expected = reference(logits.float(), bitmask, [0, 1]).to(dtype)
    apply_token_bitmask_(logits, torch.from_numpy(bitmask))
    assert logits.dtype == dtype and torch.equal(logits, expected)


def test_bad_shapes_and_empty_batches() -> None:
    logits = torch.randn(3, 64)
    with pytest.raises(ValueError):
        apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32))  # 2 masks for 3 rows
    with pytest.raises(ValueError):
        apply_token_bitmask_(logits, torch.zeros(1, 2, dtype=torch.int64), [0])
    with pytest.raises(ValueError):
        apply_token_bitmask_(logits[0], torch.zeros(1, 2, dtype=torch.int32))
    before = logits.clone()
    apply_token_bitmask_(logits, torch.zeros(0, 2, dtype=torch.int32), [])
    assert torch.equal(logits, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_with_a_cpu_mask() -> None:
    bitmask = random_bitmask(3, 4100, seed=6)
    logits = torch.randn(5, 4100)
    expected = reference(logits, bitmask, [4, 0, 2])
    on_gpu = logits.cuda()
    apply_token_bitmask_(on_gpu, torch.from_numpy(bitmask), [4, 0, 2])
    assert torch.equal(on_gpu.cpu(), expected)
