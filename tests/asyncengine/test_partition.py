"""Pipeline layer partitions: explicit ones are checked, the default balances the LM head's cost."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, LlamaConfig

from asyncengine.config import default_partition, layer_range
from asyncengine.errors import ConfigError
from asyncengine.models.loader import lm_head_cost


@pytest.mark.parametrize(
    "num_layers,pp_size,expected",
    [(12, 2, (6, 6)), (3, 2, (2, 1)), (5, 3, (2, 2, 1)), (7, 7, (1,) * 7), (9, 1, (9,))],
)
def test_without_head_cost_the_split_is_even_with_the_remainder_first(num_layers, pp_size, expected) -> None:
    assert default_partition(num_layers, pp_size) == expected


@pytest.mark.parametrize("num_layers", [2, 3, 5, 8, 12, 13, 32])
@pytest.mark.parametrize("pp_size", [2, 3, 4])
@pytest.mark.parametrize("head_cost", [0.0, 0.4, 1.7, 5.0])
def test_default_partition_minimises_the_busiest_stage(num_layers, pp_size, head_cost) -> None:
    if num_layers < pp_size:
        with pytest.raises(ConfigError):
            default_partition(num_layers, pp_size, head_cost)
        return
    parts = default_partition(num_layers, pp_size, head_cost)
    assert sum(parts) == num_layers and min(parts) >= 1 and len(parts) == pp_size
    busiest = max(*parts[:-1], parts[-1] + head_cost)
    # no split with a lighter busiest stage exists: brute force over the last stage's share and the
    # best possible (even) spread of the rest
    best = min(
        max(-(-(num_layers - last) // (pp_size - 1)), last + head_cost)
        for last in range(1, num_layers - pp_size + 2)
    )
    assert busiest == pytest.approx(best)


def test_layer_ranges_tile_the_model() -> None:
    ranges = [layer_range(12, r, 2, None, head_cost=1.7) for r in range(2)]
    assert ranges == [(0, 7), (7, 12)]
    assert layer_range(12, 1, 2, (4, 8), head_cost=1.7) == (4, 12)  # explicit partitions win
    with pytest.raises(ConfigError):
        layer_range(12, 0, 2, (4, 7))


def test_lm_head_cost_counts_the_vocab_matmul_in_layers() -> None:
    llama = LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=32000,
        num_hidden_layers=12,
    )
    layer = 4 * 768 * 768 + 3 * 768 * 2048
    assert lm_head_cost(llama) == pytest.approx(0.5 * 32000 * 768 / layer)
    gqa = LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
    )
    assert lm_head_cost(gqa) > lm_head_cost(llama)  # smaller K/V projections: the head weighs more
    gpt2 = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000)
    assert lm_head_cost(gpt2) == pytest.approx(0.5 * 1000 * 64 / (4 * 64 * 64 + 2 * 64 * 256))
