"""compressed-tensors checkpoints in the `pack-quantized` format (llm-compressor's W4A16 / W8A16).

Per linear layer, with K inputs, N outputs and G groups (1 for the "channel" strategy):
  weight_packed     [N, ceil(K / (32 / bits))] int32: codes packed along K, the first in the lowest bits,
                    stored as the signed code + 2**(bits - 1);
  weight_scale      [N, G];
  weight_zero_point [ceil(N / (32 / bits)), G] int32, asymmetric only: signed zeros + 2**(bits - 1), packed
                    along N;
  weight_g_idx      [K] int32, with activation ordering ("group" actorder);
  weight_shape      [2]: the unpacked shape (not needed: the layer knows it).
w[n, k] = (code - zero) * scale: both offsets cancel, so the stored (unsigned) values are used as they are,
with zero 2**(bits - 1) when symmetric.
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
    layer_groups,
    num_groups,
)
from asyncengine.quantization.packing import unpack_int32


class CompressedTensorsLinearMethod(QuantLinearMethod):
    param_names = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx")

    def optional(self, name: str) -> bool:
        return name == "weight_g_idx"

    def create_weights(self, layer: Any) -> None:
        cfg = self.config
        pack = cfg.pack_factor
        k, n = layer.in_per_rank, layer.out_per_rank
        groups = num_groups(layer.input_shard()[2], cfg.group_size)
        add_param(layer, "weight_packed", (n, -(-k // pack)), torch.int32, ShardDims(0, 1, 1, pack))
        add_param(layer, "weight_scale", (n, groups), torch.float32, ShardDims(0, None))
        if not cfg.sym:
            add_param(
                layer, "weight_zero_point", (-(-n // pack), groups), torch.int32, ShardDims(0, None, pack)
            )
        add_g_idx(layer, "weight_g_idx")

    def canonical(self, layer: Any) -> Canonical:
        cfg = self.config
        k, n = layer.in_per_rank, layer.out_per_rank
        q = unpack_int32(layer.weight_packed.cpu(), cfg.bits, 1, k)  # [N, K]
        scales = layer.weight_scale.cpu().t()  # [G, N]
        if cfg.sym:
            zeros = torch.full_like(scales, float(1 << (cfg.bits - 1)))
        else:
            zeros = unpack_int32(layer.weight_zero_point.cpu(), cfg.bits, 0, n).t().float()
        g_idx = layer.weight_g_idx.cpu().to(torch.int64)
        groups = layer_groups(layer, cfg.group_size) if bool((g_idx < 0).any()) else g_idx
        return build(q, groups, scales, zeros, QTYPE_U4 if cfg.bits == 4 else QTYPE_U8)
