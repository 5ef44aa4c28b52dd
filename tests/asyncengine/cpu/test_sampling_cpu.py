"""csrc/sampling.c (cpu/sampling.py) against a plain-Python reference of the same filters and draw, and the
Sampler's CPU path against its torch path in distribution."""

from __future__ import annotations

import math

import pytest
import torch

from asyncengine.cpu import sampling as cs
from asyncengine.layers.sampler import Sampler, SamplingRow
from asyncengine.transport.wire import SamplingOptions

BUILDS = [False, True]  # the AVX-512 build where the CPU has it, and the plain-C one


def reference(row: torch.Tensor, t: float, k: int, p: float, min_p: float, u: float) -> int:
    """The token the kernel must pick: top-k, top-p over the top-k tokens' mass, then min-p, ties at a cut
    keeping the lower ids (the order is x descending, then id ascending); then the first token whose
    running sum of exp(x - max), in id order, exceeds u times their total."""
    if t == 0.0:
        return int(row.float().argmax())
    x = row.float() / torch.tensor(t, dtype=torch.float32)
    vocab = x.numel()
    order = sorted(range(vocab), key=lambda j: (-float(x[j]), j))
    e = torch.exp(x.double() - float(x.max()))
    keep = order[:k] if 0 < k < vocab else order
    if p < 1.0:
        mass, run, nucleus = sum(float(e[j]) for j in keep), 0.0, []
        for j in keep:
            nucleus.append(j)
            run += float(e[j])
            if run >= p * mass:
                break
        keep = nucleus
    keep = sorted(j for j in keep if float(e[j]) >= min_p)
    total, run = sum(float(e[j]) for j in keep), 0.0
    for j in keep:
        run += float(e[j])
        if run > u * total:
            return j
    return keep[-1]


def _far_from_edges(row: torch.Tensor, t: float, k: int, p: float, min_p: float, u: float) -> bool:
    """Whether float32 rounding cannot move this case across a boundary: u not within 1e-4 of a CDF step
    and the top-p mass not within 1e-4 of a token's running sum (the kernel sums in another order)."""
    if t == 0.0:
        return True
    x = (row.float() / torch.tensor(t, dtype=torch.float32)).double()
    e = torch.exp(x - x.max())
    order = sorted(range(x.numel()), key=lambda j: (-float(x[j]), j))
    keep = order[:k] if 0 < k < x.numel() else order
    run = torch.tensor([float(e[j]) for j in keep]).cumsum(0)
    if p < 1.0 and (run / run[-1] - p).abs().min() < 1e-4:
        return False
    if min_p > 0 and (e - min_p).abs().min() < 1e-6:
        return False
    probs = e / e.sum()
    return bool(((probs.cumsum(0) - u).abs() > 1e-4).all())


@pytest.mark.parametrize("portable", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference(portable: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    checked = 0
    for vocab in (1, 7, 33, 600, 1500):
        for _ in range(12):
            rows = 8
            logits = (torch.randn(rows, vocab, generator=g) * float(torch.rand(1, generator=g) * 4)).to(dtype)
            logits[1, : vocab // 3] = float("-inf")  # masked tokens (a grammar, min_tokens)
            t = [float(x) for x in torch.rand(rows, generator=g) * 1.5 + 0.05]
            t[0] = 0.0  # a greedy row among sampled ones
            k = [int(x) for x in torch.randint(0, vocab + 2, (rows,), generator=g)]
            p = [float(x) if x < 0.9 else 1.0 for x in torch.rand(rows, generator=g)]
            mp = [float(x) * 0.3 if x < 0.5 else 0.0 for x in torch.rand(rows, generator=g)]
            u = torch.rand(rows, dtype=torch.float64, generator=g)
            out = cs.sample_rows(logits, t, k, p, mp, u, portable=portable)
            assert out is not None and out.dtype == torch.int64
            for i in range(rows):
                args = (logits[i], t[i], k[i], p[i], mp[i], float(u[i]))
                if _far_from_edges(*args):
                    assert int(out[i]) == reference(*args), (vocab, i, args[1:])
                    checked += 1
    assert checked > 300


@pytest.mark.parametrize("portable", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_rows_cut_among_the_head_tokens(portable: bool, dtype: torch.dtype) -> None:
    # a trained model's logits: a few tokens far above the rest, where the cuts run over those alone
    # (csrc/sampling.c's head_tokens); top-k past the head and top-p past its mass take the full path
    g = torch.Generator().manual_seed(4)
    rows, vocab = 16, 3000
    logits = torch.randn(rows, vocab, generator=g) * 2.5
    for i in range(rows):
        top = torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
        logits[i, top] += 14 + torch.rand(len(top), generator=g) * 6
    logits = logits.to(dtype)
    for k, p in [(5, 1.0), (0, 0.9), (20, 0.5), (200, 1.0), (0, 0.999999), (3, 0.999)]:
        u = torch.rand(rows, dtype=torch.float64, generator=g)
        out = cs.sample_rows(logits, [1.0] * rows, [k] * rows, [p] * rows, [0.0] * rows, u, portable=portable)
        for i in range(rows):
            args = (logits[i], 1.0, k, p, 0.0, float(u[i]))
            if _far_from_edges(*args):
                assert int(out[i]) == reference(*args), (k, p, i)


@pytest.mark.parametrize("portable", BUILDS)
def test_a_heavy_tail_is_not_cut_off(portable: bool) -> None:
    # one token 12.5 above 49,999 tied ones: the head (the one token) holds 84% of the mass, so top-p 0.9
    # must reach into the tail (the first ~18,200 tail ids by the tie rule): the top token's share
    # falls from 1 to ~0.937; top-p 0.8 keeps the top token alone
    vocab = 50000
    logits = torch.zeros(1, vocab)
    logits[0, 777] = 12.5
    n = 2000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    rows = logits.expand(n, -1).contiguous()
    tail = math.exp(-12.5)
    for p in (0.9, 0.8):
        out = cs.sample_rows(rows, [1.0] * n, [0] * n, [p] * n, [0.0] * n, u, portable=portable)
        kept_tail = math.ceil((p * (1 + (vocab - 1) * tail) - 1) / tail) if p == 0.9 else 0
        share = 1 / (1 + kept_tail * tail)
        assert abs(float((out == 777).double().mean()) - share) < 2 / n, (p, share)
        assert int(out.max()) <= max(kept_tail, 777)  # the tie rule: the lowest tail ids


@pytest.mark.parametrize("portable", BUILDS)
def test_ties_at_a_cut_keep_the_lower_ids(portable: bool) -> None:
    # bfloat16 logits tie often: top-k of equal values keeps the first k ids
    logits = torch.zeros(1, 10, dtype=torch.bfloat16)
    logits[0, 7] = 1.0  # the top token, then nine tied ones
    picks = set()
    for i in range(200):
        u = torch.tensor([(i + 0.5) / 200], dtype=torch.float64)
        picks.add(int(cs.sample_rows(logits, [1.0], [3], [1.0], [0.0], u, portable=portable)[0]))
    assert picks == {7, 0, 1}


@pytest.mark.parametrize("portable", BUILDS)
def test_draws_follow_the_filtered_distribution(portable: bool) -> None:
    # inverse CDF: uniforms on a fine grid land on each kept token in proportion to its probability
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0, 3.0, 0.0]])
    n = 4000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    rows = logits.expand(n, -1).contiguous()
    for t, k, p, min_p in [(1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 4, 0.9, 0.1)]:
        out = cs.sample_rows(rows, [t] * n, [k] * n, [p] * n, [min_p] * n, u, portable=portable)
        freq = torch.bincount(out, minlength=6).double() / n
        x = (logits[0] / t).double()
        e = torch.exp(x - x.max())
        order = sorted(range(6), key=lambda j: -float(x[j]))
        keep = order[:k] if k else order
        if p < 1.0:
            mass = sum(float(e[j]) for j in keep)
            cum = torch.tensor([float(e[j]) for j in keep]).cumsum(0)
            keep = keep[: int((cum < p * mass).sum()) + 1]
        keep = [j for j in keep if float(e[j]) >= min_p]
        want = torch.zeros(6, dtype=torch.float64)
        want[keep] = e[keep] / e[keep].sum()
        assert torch.allclose(freq, want, atol=1.5 / n), (t, k, p, min_p, freq, want)


@pytest.mark.parametrize("portable", BUILDS)
def test_rows_without_a_distribution(portable: bool) -> None:
    logits = torch.tensor(
        [
            [0.0, float("nan"), 1.0, float("nan")],  # a NaN: its first index, as argmax
            [float("-inf")] * 4,  # nothing to draw from: argmax's answer (0)
            [1.0, float("inf"), 2.0, float("inf")],  # an infinite logit: the first one
            [-1e30, -1e30, 5.0, -1e30],  # one token holds all the mass
        ]
    )
    u = torch.full((4,), 0.999, dtype=torch.float64)
    out = cs.sample_rows(logits, [1.0] * 4, [0] * 4, [0.5] * 4, [0.0] * 4, u, portable=portable)
    assert out.tolist() == [1, 0, 1, 2]


def test_not_applicable_returns_none() -> None:
    u = torch.zeros(2, dtype=torch.float64)
    assert (
        cs.sample_rows(torch.zeros(2, 5, dtype=torch.float16), [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, u)
        is None
    )
    assert cs.sample_rows(torch.zeros(5, 2).t(), [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, u) is None


def _rows(n: int, seed: int | None = None, **kw: float) -> list[SamplingRow]:
    opts = SamplingOptions(**kw)
    gen = None
    out = []
    for _ in range(n):
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
        out.append(SamplingRow(opts, gen, [], {}, 0))
    return out


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=1.2, top_k=3, min_p=0.05)],
)
def test_sampler_cpu_kernel_and_torch_path_sample_the_same_distribution(params: dict[str, float]) -> None:
    # the same [n, 8] logits through both paths: token frequencies agree within sampling noise
    g = torch.Generator().manual_seed(3)
    n = 6000
    logits = (torch.randn(1, 8, generator=g) * 1.5).expand(n, -1).contiguous().to(torch.bfloat16)
    rows = _rows(n, **params)
    counts = {}
    for enabled in (True, False):
        saved, cs._enabled = cs._enabled, enabled
        try:
            tokens = Sampler(seed=5, device=torch.device("cpu"))(logits, rows).token_ids
        finally:
            cs._enabled = saved
        counts[enabled] = torch.bincount(torch.tensor(tokens), minlength=8).double()
    a, b = counts[True], counts[False]
    # the two frequency vectors differ by at most ~4.5 standard errors in every token
    sd = torch.sqrt((a + b) / 2 * (1 - (a + b) / (2 * n)) * 2).clamp(min=1.0)
    assert ((a - b).abs() / sd).max() < 4.5, (a, b)
    assert (a > 0).sum() == (b > 0).sum()  # the same tokens can be drawn


def test_sampler_seeded_rows_ignore_their_batch() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g)
    seeded = _rows(1, seed=1234, temperature=1.0, top_p=0.9)[0]
    alone = Sampler(seed=0, device=torch.device("cpu"))(
        logits[:1], [seeded._replace(generator=torch.Generator().manual_seed(1234))]
    )
    crowd_rows = [seeded._replace(generator=torch.Generator().manual_seed(1234))] + _rows(5, temperature=1.0)
    crowd = Sampler(seed=9, device=torch.device("cpu"))(logits, crowd_rows)
    assert alone.token_ids[0] == crowd.token_ids[0]


def test_sampler_greedy_rows_in_a_sampled_batch_take_the_argmax() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 500, generator=g).to(torch.bfloat16)
    rows = _rows(2, temperature=0.0) + _rows(2, temperature=1.0)
    out = Sampler(seed=0, device=torch.device("cpu"))(logits, rows).token_ids
    assert out[:2] == logits[:2].float().argmax(dim=-1).tolist()
    assert all(0 <= t < 500 for t in out)
