"""Sampler: penalties, greedy / temperature / top-k / top-p / min-p sampling, and logprobs.

Logprobs are those of the raw model distribution (log-softmax of the logits before any penalty or
temperature), as vLLM and OpenAI report them. On CPU the sampling itself is cpu/sampling.py's kernel
(one uniform draw a row, inverse CDF, radix-selected cuts); elsewhere torch's exponential race.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from asyncengine.cpu import ops as cpu_ops
from asyncengine.cpu import sampling as cpu_sampling
from asyncengine.transport.wire import SamplingOptions, TokenLogprobs


class _Column:
    """A growing numpy array (amortised appends), read as a view."""

    def __init__(self, dtype: type) -> None:
        self.buf, self.n = np.empty(16, dtype=dtype), 0

    def append(self, value: float) -> None:
        if self.n == len(self.buf):
            self.buf = np.concatenate([self.buf, np.empty_like(self.buf)])
        self.buf[self.n] = value
        self.n += 1

    @property
    def values(self) -> np.ndarray:
        return self.buf[: self.n]


class PenaltyState:
    """One sequence's tokens as the sampler's penalties read them, kept up to date as tokens are
    appended or rolled back: its distinct ids (prompt and output: the repetition penalty's) and its
    distinct output ids with their counts (frequency / presence), as arrays, so that a step's penalties
    are one gather and one scatter over every penalised row's ids. Built from the lists at every step
    instead (a set of a row's ids, then torch ops per row) they took ~8.5 ms a step at batch 64 with
    100-1000-token histories; dense [N, V] masks ~11 ms (torch.where over [64, 32000]). Memory follows
    the distinct tokens, not the vocabulary. Ids outside [0, vocab) are left out: the logits have no
    column for them."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int, vocab: int) -> None:
        self.vocab = vocab
        self.in_prompt = {t for t in token_ids[:num_prompt_tokens] if 0 <= t < vocab}
        self.seen_ids = _Column(np.int64)  # distinct ids of the prompt and the output
        for t in sorted(self.in_prompt):
            self.seen_ids.append(t)
        self.seen = set(self.in_prompt)
        self.output_ids = _Column(np.int64)  # distinct output ids ...
        self.counts = _Column(np.float32)  # ... and how often each occurs
        self.slot: dict[int, int] = {}  # output id -> its place in output_ids / counts
        for t in token_ids[num_prompt_tokens:]:
            self.add(t)

    def add(self, token: int) -> None:
        if not 0 <= token < self.vocab:
            return
        slot = self.slot.get(token)
        if slot is None:
            self.slot[token] = self.output_ids.n
            self.output_ids.append(token)
            self.counts.append(1.0)
        else:
            self.counts.buf[slot] += 1.0
        if token not in self.seen:
            self.seen.add(token)
            self.seen_ids.append(token)

    def remove(self, token: int) -> None:
        """Undoes add (rejected drafts: rare, so a token that leaves rebuilds the arrays)."""
        if not 0 <= token < self.vocab:
            return
        slot = self.slot[token]
        self.counts.buf[slot] -= 1.0
        if self.counts.buf[slot] > 0:
            return
        kept = [(t, c) for t, c in zip(self.output_ids.values.tolist(), self.counts.values.tolist()) if c > 0]
        self.output_ids, self.counts, self.slot = _Column(np.int64), _Column(np.float32), {}
        for t, c in kept:
            self.slot[t] = self.output_ids.n
            self.output_ids.append(t)
            self.counts.append(c)
        if token not in self.in_prompt:
            self.seen.discard(token)
            self.seen_ids = _Column(np.int64)
            for t in self.seen:
                self.seen_ids.append(t)


class SamplingRow(NamedTuple):
    """What the sampler needs of one sequence that samples this step."""

    options: SamplingOptions
    generator: torch.Generator | None
    prompt_and_output_ids: list[int]  # for repetition penalty
    output_counts: dict[int, int]  # for presence / frequency penalties and min_tokens
    num_output_tokens: int
    # the two above as the worker keeps them up to date for sequences with penalties; None: the sampler
    # reads the lists (per row, slower)
    penalties: PenaltyState | None = None


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked for logprobs


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        # NOTE: unseeded rows share this generator, so their draws depend on the batch; seeded rows don't.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        if device.type == "cpu":  # built (once per machine) at start-up, not in the first sampled step
            cpu_sampling.load_sampling_library()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        # [N, V] in the model's dtype. Plain greedy rows need only the argmax, which is the same in
        # any dtype (widening is exact); penalties and logprobs work on float32, the CPU sampling
        # kernel on the logits as they are.
        lp_rows = [i for i, r in enumerate(rows) if r.options.logprobs is not None]
        penalized = any(_penalized(r) for r in rows)
        greedy = [r.options.temperature == 0.0 for r in rows]
        if all(greedy) and not lp_rows and not penalized:
            return SamplerOutput(argmax_rows(logits).tolist(), None)
        # the raw distribution's logprobs, taken before the penalties change the logits
        lp = logits[lp_rows].float().log_softmax(dim=-1) if lp_rows else None  # [len(lp_rows), V]
        if penalized:  # (the CPU sampling kernel reads bfloat16 logits as they are)
            logits = self._apply_penalties(logits.float(), rows)  # [N, V]
        if all(greedy):
            token_ids = argmax_rows(logits).tolist()
        else:
            token_ids = self._sample(logits, rows, greedy)
        logprobs = self._logprobs(lp, lp_rows, rows, token_ids) if lp is not None else None
        return SamplerOutput(token_ids, logprobs)

    # -- penalties -------------------------------------------------------------------------------
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[-1]
        # rows with a PenaltyState: the repetition and the count penalties over all of their ids at once
        dense = [r.penalties is not None and r.penalties.vocab == vocab for r in rows]

        def pairs(idx: list[int], field: str) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
            """(row, id) of every id in those rows' `field` id lists, and which of idx each came from."""
            lists = [getattr(rows[i].penalties, field).values for i in idx]
            which = np.repeat(np.arange(len(idx)), [len(x) for x in lists])
            where = torch.from_numpy(np.asarray(idx, dtype=np.int64)[which]).to(logits.device)
            return where, torch.from_numpy(np.concatenate(lists)).to(logits.device), which

        def per_pair(idx: list[int], which: np.ndarray, option: str) -> torch.Tensor:  # an option, per pair
            values = np.asarray([getattr(rows[i].options, option) for i in idx], dtype=np.float32)
            return torch.from_numpy(values[which]).to(logits.device)

        rep = [i for i, r in enumerate(rows) if dense[i] and r.options.repetition_penalty != 1.0]
        if rep:
            r_idx, ids, which = pairs(rep, "seen_ids")
            picked, pen = logits[r_idx, ids], per_pair(rep, which, "repetition_penalty")
            logits[r_idx, ids] = torch.where(picked > 0, picked / pen, picked * pen)
        cnt = [i for i, r in enumerate(rows) if dense[i] and _counts_penalized(r)]
        if cnt:
            r_idx, ids, which = pairs(cnt, "output_ids")
            counts = torch.from_numpy(np.concatenate([rows[i].penalties.counts.values for i in cnt]))
            freq, pres = per_pair(cnt, which, "frequency_penalty"), per_pair(cnt, which, "presence_penalty")
            logits[r_idx, ids] -= freq * counts.to(logits.device) + pres
        for i, row in enumerate(rows):
            opt = row.options
            if _bans_stop_tokens(row):
                banned = [t for t in opt.min_tokens_banned_ids if t < vocab]
                logits[i, banned] = float("-inf")
            if dense[i]:
                continue
            if opt.repetition_penalty != 1.0:
                ids = torch.tensor(
                    sorted(set(row.prompt_and_output_ids)), dtype=torch.long, device=logits.device
                )
                ids = ids[ids < vocab]
                picked = logits[i, ids]
                logits[i, ids] = torch.where(
                    picked > 0, picked / opt.repetition_penalty, picked * opt.repetition_penalty
                )
            if _counts_penalized(row):
                ids = torch.tensor(list(row.output_counts), dtype=torch.long, device=logits.device)
                counts = torch.tensor(
                    list(row.output_counts.values()), dtype=logits.dtype, device=logits.device
                )
                keep = ids < vocab
                logits[i, ids[keep]] -= opt.frequency_penalty * counts[keep] + opt.presence_penalty
        return logits

    # -- sampling --------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> list[int]:
        device = logits.device
        if cpu_sampling.applies(logits):
            fast = cpu_sampling.sample_rows(
                logits,
                [r.options.temperature for r in rows],  # 0: greedy, as below
                [r.options.top_k for r in rows],
                [r.options.top_p for r in rows],
                [r.options.min_p for r in rows],
                self._uniforms(rows),
            )
            if fast is not None:
                return fast.tolist()
        logits = logits.float()  # [N, V]
        temps = torch.tensor([r.options.temperature or 1.0 for r in rows], device=device)
        logits = logits / temps[:, None]
        top_k = [r.options.top_k for r in rows]
        top_p = [r.options.top_p for r in rows]
        min_p = [r.options.min_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)  # [N, V]
        if any(p > 0.0 for p in min_p):
            mp = torch.tensor(min_p, device=device)
            probs = probs.masked_fill(probs < mp[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        # Exponential race (Gumbel-max in disguise): argmax(p / q), q ~ Exp(1), samples from p without
        # the host sync of torch.multinomial; each seeded row draws from its own generator.
        q = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            q[shared] = torch.empty(len(shared), probs.shape[-1], device=device).exponential_(
                generator=self.generator
            )
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        sampled = argmax_rows(probs / q)
        greedy_ids = argmax_rows(logits)
        mask = torch.tensor(greedy, device=device)
        return torch.where(mask, greedy_ids, sampled).tolist()

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One uniform draw in [0, 1) a row ([N] float64, CPU), from the row's own generator where it has
        one, so that a seeded request samples the same tokens in any batch."""
        u = torch.empty(len(rows), dtype=torch.float64)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), dtype=torch.float64, generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand(1, dtype=torch.float64, generator=r.generator)[0]
        return u

    # -- logprobs --------------------------------------------------------------------------------
    @staticmethod
    def _logprobs(
        lp: torch.Tensor,  # [M, V] float32 log-softmax of the rows asking for logprobs
        lp_rows: list[int],  # their places in the batch
        rows: list[SamplingRow],
        token_ids: list[int],
    ) -> list[TokenLogprobs | None]:
        """Per row: the sampled token's logprob and rank, then the row's top `logprobs` tokens. Batched
        (one gather, one comparison, one topk for the largest k): five small torch ops a row took ~11
        ms a step at batch 64."""
        vocab = lp.shape[-1]
        sampled = torch.tensor([token_ids[i] for i in lp_rows], dtype=torch.long, device=lp.device)
        sampled_lp = lp.gather(1, sampled[:, None])  # [M, 1]
        ranks = ((lp > sampled_lp).sum(dim=-1, dtype=torch.int32) + 1).tolist()  # (int32: half the time)
        sampled_values = sampled_lp[:, 0].tolist()
        ks = [min(rows[i].options.logprobs or 0, vocab) for i in lp_rows]  # a small vocabulary caps k
        top_ids: list[list[int]] = [[] for _ in lp_rows]
        top_lps: list[list[float]] = [[] for _ in lp_rows]
        if max(ks):
            top = lp.topk(max(ks), dim=-1)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        out: list[TokenLogprobs | None] = [None] * len(rows)
        for m, (i, k) in enumerate(zip(lp_rows, ks)):
            out[i] = TokenLogprobs(
                [token_ids[i], *top_ids[m][:k]],
                [sampled_values[m], *top_lps[m][:k]],
                [ranks[m], *range(1, k + 1)],
            )
        return out


def has_penalties(opt: SamplingOptions) -> bool:
    """A repetition, frequency or presence penalty: the options a PenaltyState serves."""
    return opt.repetition_penalty != 1.0 or bool(opt.frequency_penalty) or bool(opt.presence_penalty)


def _bans_stop_tokens(row: SamplingRow) -> bool:
    """min_tokens not reached yet: EOS and the stop token ids must not be sampled."""
    opt = row.options
    return bool(opt.min_tokens and row.num_output_tokens < opt.min_tokens and opt.min_tokens_banned_ids)


def _counts_penalized(row: SamplingRow) -> bool:
    """A presence or frequency penalty, and output tokens for it to count."""
    opt = row.options
    return bool((opt.presence_penalty or opt.frequency_penalty) and row.output_counts)


def _penalized(row: SamplingRow) -> bool:
    """Whether _apply_penalties would change this row's logits."""
    return _bans_stop_tokens(row) or row.options.repetition_penalty != 1.0 or _counts_penalized(row)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N]
    """The first index of each row's maximum (a NaN's where the row has one), as argmax. On CPU this is
    cpu_ops.argmax_rows: 0.1 ms for [64, 32000] bfloat16 logits read as they are, where torch needs a
    float32 copy and max(dim) (0.9 ms), and its argmax, a serial reduction, 1.7 ms in float32."""
    fast = cpu_ops.argmax_rows(x)  # None off CPU, or without the compiled ops
    return fast if fast is not None else x.max(dim=-1).indices


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) every token outside each row's top-k and nucleus top-p."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    device = logits.device
    k = torch.tensor([min(x, vocab) if x > 0 else vocab for x in top_k], device=device)
    positions = torch.arange(vocab, device=device)[None, :]
    mask = positions >= k[:, None]
    p = torch.tensor(top_p, device=device)
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    # drop a token once the mass strictly before it already reaches top_p (the top token always stays)
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= mass_before >= p[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
