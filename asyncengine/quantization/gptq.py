"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum), 4 or 8 bits.

Per linear layer, with K inputs, N outputs, G = ceil(K / group_size) groups (1 per channel for -1):
  qweight [K / (32 / bits), N] int32: codes packed along K, the first in the lowest bits;
  qzeros  [G, N / (32 / bits)] int32: zero points packed along N, the same way;
  scales  [G, N] float16;
  g_idx   [K] int32: each input column's group (act-order / desc_act: a permutation of k // group_size;
          older files without desc_act may leave it out).
w[n, k] = (code - zero) * scale of group g_idx[k]. Format v1 ("gptq", AutoGPTQ's) stores zero - 1 in
qzeros, wrapping in `bits` bits (a symmetric 4-bit file holds 7 for 8); v2 ("gptq_v2") the zero itself.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.quantization.canonical import QTYPE_U4, QTYPE_U8, Canonical, build
from asyncengine.quantization.method import (
    QuantLinearMethod,
    ShardDims,
    add_g_idx,
    add_param,
    divided,
    layer_groups,
    num_groups,
)
from asyncengine.quantization.packing import unpack_int32


class GPTQLinearMethod(QuantLinearMethod):
    param_names = ("qweight", "qzeros", "scales", "g_idx")

    def optional(self, name: str) -> bool:
        return name == "g_idx"

    def create_weights(self, layer: Any) -> None:
        cfg = self.config
        pack = cfg.pack_factor
        k, n = layer.in_per_rank, layer.out_per_rank
        groups = num_groups(layer.input_shard()[2], cfg.group_size)  # every group, also on a row shard
        add_param(
            layer, "qweight", (divided(k, pack, "input size"), n), torch.int32, ShardDims(1, 0, 1, pack)
        )
        add_param(
            layer, "qzeros", (groups, divided(n, pack, "output size")), torch.int32, ShardDims(1, None, pack)
        )
        add_param(layer, "scales", (groups, n), torch.float32, ShardDims(1, None))
        add_g_idx(layer, "g_idx")

    def canonical(self, layer: Any) -> Canonical:
        cfg = self.config
        k, n = layer.in_per_rank, layer.out_per_rank
        q = unpack_int32(layer.qweight.cpu(), cfg.bits, 0, k).t()  # [N, K]
        zeros = unpack_int32(layer.qzeros.cpu(), cfg.bits, 1, n).to(torch.int32)  # [G, N]
        if cfg.zero_minus_one:
            zeros = (zeros + 1) & ((1 << cfg.bits) - 1)
        g_idx = layer.g_idx.cpu().to(torch.int64)
        groups = layer_groups(layer, cfg.group_size) if bool((g_idx < 0).any()) else g_idx
        qtype = QTYPE_U4 if cfg.bits == 4 else QTYPE_U8
        return build(q, groups, layer.scales.cpu(), zeros.float(), qtype)
