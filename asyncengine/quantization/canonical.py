"""One layout for every quantized format: what the kernels take.

Every format reduces to integer (or e4m3) codes q[n, k], a group per input column k, and per-(group, n)
scales and zero points: w[n, k] = (q[n, k] - zero[g(k), n]) * scale[g(k), n] (fp8: decode(q) * scale).
Kernels want a group to be a contiguous, equally long run of k. GPTQ's act-order (g_idx) scatters a
group's columns over k, and a tensor-parallel shard of the input dim may hold parts of groups; so the
columns are sorted by group, every group is padded to one length (padding codes meet zero activations),
and the input columns follow a permutation `perm` (gathered once per GEMM). Without act-order, and
with shards aligned to the group size, there is no permutation and no padding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

QTYPE_U4, QTYPE_U8, QTYPE_FP8 = 0, 1, 2


class Canonical(NamedTuple):
    qtype: int  # QTYPE_*
    q: torch.Tensor  # [N, K_int] uint8: codes (4-bit ones < 16) or e4m3 bytes
    scales: torch.Tensor  # [G, N] float32
    zeros: torch.Tensor | None  # [G, N] float32; None for fp8
    group_size: int  # K_int = G * group_size (even)
    perm: torch.Tensor | None  # [K_int] int64: the input column of internal column k, -1 a pad; None: k
    in_features: int  # K, the activations' width

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    def dequantize(self) -> torch.Tensor:  # [N, K_int] float32, in the internal column order
        if self.qtype == QTYPE_FP8:
            w = self.q.view(torch.float8_e4m3fn).float()
        else:
            w = self.q.float() - self.zeros.repeat_interleave(self.group_size, 0).t()  # type: ignore[union-attr]
        return w * self.scales.repeat_interleave(self.group_size, 0).t()

    def dequantize_original(self) -> torch.Tensor:  # [N, K] float32, in the checkpoint's column order
        w = self.dequantize()
        if self.perm is None:
            return w[:, : self.in_features].contiguous()
        out = torch.zeros(self.out_features, self.in_features)
        keep = self.perm >= 0
        out[:, self.perm[keep]] = w[:, keep]
        return out

    def gather_input(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, K_int], zero-padded
        k_int = self.q.shape[1]
        if self.perm is None:
            return torch.nn.functional.pad(x, (0, k_int - self.in_features)) if k_int != x.shape[1] else x
        padded = torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=1)  # column K: the zero that pads read
        return padded[:, torch.where(self.perm >= 0, self.perm, self.in_features)]


def build(
    q: torch.Tensor,  # [N, K] uint8
    groups: torch.Tensor,  # [K] int64: each input column's group (an index into scales' rows)
    scales: torch.Tensor,  # [G_total, N] float32
    zeros: torch.Tensor | None,  # [G_total, N] float32
    qtype: int,
) -> Canonical:
    """The canonical layout of one layer's shard (see the module docstring)."""
    n, k = q.shape
    groups = groups.to(torch.int64)
    present, counts = torch.unique(groups, return_counts=True)  # sorted
    size = int(counts.max())
    size += size % 2  # 4-bit codes go two to a byte along k
    ascending = bool((groups[1:] >= groups[:-1]).all())
    regular = ascending and bool((counts[:-1] == size).all())
    pick = present.tolist()
    scales_int = scales[pick].float().contiguous()
    zeros_int = zeros[pick].float().contiguous() if zeros is not None else None
    k_int = len(pick) * size
    if regular:  # groups already contiguous and full: only a zero tail past K
        q_int = torch.zeros(n, k_int, dtype=torch.uint8)
        q_int[:, :k] = q
        return Canonical(qtype, q_int, scales_int, zeros_int, size, None, k)
    order = torch.sort(groups, stable=True).indices  # columns by group, in column order within one
    slot_group = torch.repeat_interleave(torch.arange(len(pick)), counts)  # [K] the run of each sorted column
    run_start = torch.cumsum(counts, 0) - counts
    within = torch.arange(k) - torch.repeat_interleave(run_start, counts)
    slots = slot_group * size + within
    perm = torch.full((k_int,), -1, dtype=torch.int64)
    perm[slots] = order
    q_int = torch.zeros(n, k_int, dtype=torch.uint8)
    q_int[:, slots] = q[:, order]
    return Canonical(qtype, q_int, scales_int, zeros_int, size, perm, k)
