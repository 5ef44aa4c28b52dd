"""AWQ checkpoints in the GEMM layout (AutoAWQ, `version: gemm`), 4 bits with zero points.

Per linear layer, with K inputs, N outputs, G = K / group_size groups:
  qweight [K, N / 8] int32: codes packed along N, eight to a word in AWQ_ORDER (packing.py);
  qzeros  [G, N / 8] int32: zero points, packed the same way;
  scales  [G, N] float16.
w[n, k] = (code - zero) * scale of group k // group_size; no act-order.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.quantization.canonical import QTYPE_U4, Canonical, build
from asyncengine.quantization.method import (
    QuantLinearMethod,
    ShardDims,
    add_param,
    divided,
    layer_groups,
    num_groups,
)
from asyncengine.quantization.packing import AWQ_ORDER, unpack_int32


class AWQLinearMethod(QuantLinearMethod):
    param_names = ("qweight", "qzeros", "scales")

    def create_weights(self, layer: Any) -> None:
        k, n = layer.in_per_rank, layer.out_per_rank
        groups = num_groups(layer.input_shard()[2], self.config.group_size)
        words = divided(n, 8, "output size")
        add_param(layer, "qweight", (k, words), torch.int32, ShardDims(1, 0, 8))
        add_param(layer, "qzeros", (groups, words), torch.int32, ShardDims(1, None, 8))
        add_param(layer, "scales", (groups, n), torch.float32, ShardDims(1, None))

    def canonical(self, layer: Any) -> Canonical:
        n = layer.out_per_rank
        q = unpack_int32(layer.qweight.cpu(), 4, 1, n, AWQ_ORDER).t()  # [N, K]
        zeros = unpack_int32(layer.qzeros.cpu(), 4, 1, n, AWQ_ORDER).float()  # [G, N]
        groups = layer_groups(layer, self.config.group_size)
        return build(q, groups, layer.scales.cpu(), zeros, QTYPE_U4)
