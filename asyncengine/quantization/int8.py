"""`--quantization int8`: an unquantized checkpoint's linear layers quantized while they load.

Weight-only, symmetric, per output channel: scale[n] = max_k |w[n, k]| / 127 over the whole row of the
checkpoint tensor, code = round(w / scale) in [-127, 127]. Each rank quantizes the full tensor it reads
before taking its share, so a row-parallel shard's scales are the full rows' and the result does not
depend on the tensor-parallel size. The full-precision weight is never kept: only codes and scales.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine.quantization.canonical import QTYPE_U8, Canonical, build
from asyncengine.quantization.method import QuantLinearMethod, ShardDims, add_param


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> int8 codes [N, K] and float32 scales [N] (per output channel, symmetric)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


class Int8LinearMethod(QuantLinearMethod):
    param_names = ("weight", "weight_scale")

    def create_weights(self, layer: Any) -> None:
        k, n = layer.in_per_rank, layer.out_per_rank
        weight = add_param(layer, "weight", (n, k), torch.int8, ShardDims(0, 1))
        # not in the checkpoint: a buffer, so no loader expects a tensor for it
        scale = torch.zeros(n, dtype=torch.float32)
        scale.shard_dims = ShardDims(0, None)  # type: ignore[attr-defined]
        layer.register_buffer("weight_scale", scale, persistent=False)

        def load_quantized(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            codes, scales = quantize_rows(loaded)
            layer.load_sharded(param, codes, shard_id)
            layer.load_sharded(layer.weight_scale, scales, shard_id)

        weight.weight_loader = load_quantized  # type: ignore[attr-defined]

    def canonical(self, layer: Any) -> Canonical:
        return int8_canonical(layer.weight, layer.weight_scale)


def int8_canonical(codes: torch.Tensor, scales: torch.Tensor) -> Canonical:
    """int8 codes [N, K] and per-row scales [N] (quantize_rows) in the kernels' layout: one group."""
    unsigned = (codes.cpu().to(torch.int16) + 128).to(torch.uint8)  # [N, K], zero point 128
    scale_rows = scales.cpu().float()[None, :]  # [1, N]
    groups = torch.zeros(codes.shape[1], dtype=torch.int64)
    return build(unsigned, groups, scale_rows, torch.full_like(scale_rows, 128.0), QTYPE_U8)
