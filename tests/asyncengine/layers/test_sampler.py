"""Sampler unit tests: greedy picks argmax's answer (first maximal index), mixed batches, seeds."""

from __future__ import annotations

import torch

from asyncengine.layers.sampler import PenaltyState, Sampler, SamplingRow
from asyncengine.transport.wire import SamplingOptions


def _row(temperature: float = 0.0, seed: int | None = None) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingOptions(temperature=temperature), gen, [1, 2, 3], {}, 0)


def test_greedy_equals_torch_argmax_including_ties() -> None:
    logits = torch.randn(64, 32000)
    logits[3, 10] = logits[3, 20000] = 100.0  # a tie: the first index wins, as with argmax
    out = Sampler(0, torch.device("cpu"))(logits, [_row() for _ in range(64)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 10


def test_greedy_rows_unchanged_by_sampled_neighbours() -> None:
    logits = torch.randn(4, 1000)
    rows = [_row(), _row(1.0, seed=7), _row(), _row(0.8, seed=8)]
    out = Sampler(0, torch.device("cpu"))(logits, rows)
    expect = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == expect[0] and out.token_ids[2] == expect[2]
    again = Sampler(123, torch.device("cpu"))(logits, [_row(), _row(1.0, seed=7), _row(), _row(0.8, seed=8)])
    assert again.token_ids == out.token_ids  # seeded rows draw from their own generators


def test_greedy_on_bfloat16_logits_equals_their_float32_argmax() -> None:
    logits = torch.randn(33, 5000).to(torch.bfloat16)  # bf16 has few values: ties are frequent
    out = Sampler(0, torch.device("cpu"))(logits, [_row() for _ in range(33)])
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()


def test_penalised_greedy_rows_take_the_slow_path() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 2], logits[0, 5] = 1.0, 0.5  # token 2 is in the row's ids [1, 2, 3], token 5 is not
    row = SamplingRow(SamplingOptions(temperature=0.0, repetition_penalty=100.0), None, [1, 2, 3], {2: 1}, 1)
    assert Sampler(0, torch.device("cpu"))(logits, [row]).token_ids == [5]  # 1.0 / 100 < 0.5


def test_more_logprobs_than_the_vocabulary_holds() -> None:
    # logprobs=20 is valid for any request; on a model with fewer tokens it must not crash the worker
    sampler = Sampler(0, torch.device("cpu"))
    row = SamplingRow(SamplingOptions(temperature=0.0, logprobs=20, top_k=2**31 - 1), None, [1], {}, 0)
    out = sampler(torch.randn(1, 8), [row])
    lp = out.logprobs[0]
    assert len(lp.token_ids) == 1 + 8 and lp.ranks[1:] == list(range(1, 9))


def _penalised_rows(g: torch.Generator, vocab: int, dense: bool) -> list[SamplingRow]:
    rows = []
    for i in range(6):
        n_prompt, n_out = (
            int(torch.randint(1, 40, (1,), generator=g)),
            int(torch.randint(0, 30, (1,), generator=g)),
        )
        ids = torch.randint(0, vocab + 3, (n_prompt + n_out,), generator=g).tolist()  # some past the logits
        counts: dict[int, int] = {}
        for t in ids[n_prompt:]:
            counts[t] = counts.get(t, 0) + 1
        opts = SamplingOptions(
            temperature=0.0,
            repetition_penalty=[1.0, 1.3, 0.7][i % 3],
            frequency_penalty=[0.0, 0.5, -0.25][(i // 3) % 3],
            presence_penalty=[0.4, 0.0][i % 2],
        )
        state = PenaltyState(ids, n_prompt, vocab) if dense else None
        rows.append(SamplingRow(opts, None, ids, counts, n_out, state))
    return rows


def test_dense_penalties_equal_the_per_row_ones() -> None:
    # the batched path over PenaltyState arrays changes the logits exactly as the per-row path does
    vocab = 50
    for seed in range(5):
        logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(seed)) * 3
        per_row = Sampler._apply_penalties(
            logits.clone(), _penalised_rows(torch.Generator().manual_seed(seed), vocab, False)
        )
        dense = Sampler._apply_penalties(
            logits.clone(), _penalised_rows(torch.Generator().manual_seed(seed), vocab, True)
        )
        assert torch.equal(per_row, dense)
        assert not torch.equal(per_row, logits)


def _penalty_view(state: PenaltyState) -> tuple[list[int], dict[int, float]]:
    counts = dict(zip(state.output_ids.values.tolist(), state.counts.values.tolist()))
    return sorted(state.seen_ids.values.tolist()), counts


def test_penalty_state_follows_appends_and_rollbacks() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (30,), generator=g).tolist() + [25, -1]  # the last two outside the vocab
    state = PenaltyState(ids[:10], 10, 20)
    for t in ids[10:]:
        state.add(t)
    for t in ids[:-10:-1]:  # the last 9 rejected (speculative decoding)
        state.remove(t)
    kept = ids[:-9]
    seen, counts = _penalty_view(state)
    assert (seen, counts) == _penalty_view(PenaltyState(kept, 10, 20))
    assert seen == sorted(set(kept))
    assert counts == {t: float(kept[10:].count(t)) for t in set(kept[10:])}
