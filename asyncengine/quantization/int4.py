"""Load-time 4-bit quantization: asymmetric round-to-nearest per group of input columns.

For each output row n and group g of `group_size` consecutive input columns (the last group may be
shorter): scale = (max - min) / 15, code = round((w - min) / scale) in [0, 15] and w ~ code * scale + min,
as llama.cpp's Q4_1 blocks. In the kernels' form w = (code - zero) * scale the zero point is -min / scale,
a float (the kernels apply it once per group as zero * sum(x), so it need not be an integer as GPTQ's
are). Used by `--lm-head-quantization int4` and by `--quantization int4`, which quantizes an unquantized
checkpoint's linear layers while they load: each rank quantizes the full tensor it reads before taking its
share (groups count over the full input, as GPTQ's do, so a shard that cuts a group keeps its part with
the group's scale), and the result does not depend on the tensor-parallel size.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from asyncengine.quantization.canonical import QTYPE_U4, Canonical, build
from asyncengine.quantization.config import INT4_GROUP_SIZE
from asyncengine.quantization.method import QuantLinearMethod, ShardDims, add_param, layer_groups, num_groups

# as llama.cpp's 4-bit blocks; the kernels' int8 activation blocks are 32 columns too
GROUP_SIZE = INT4_GROUP_SIZE


class GroupCodes(NamedTuple):
    codes: torch.Tensor  # [N, K] uint8, each < 16
    scales: torch.Tensor  # [G, N] float32
    zeros: torch.Tensor  # [G, N] float32: -min / scale
    group_size: int

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        k = self.codes.shape[1]
        groups = torch.arange(k) // self.group_size
        return (self.codes.float() - self.zeros[groups].t()) * self.scales[groups].t()

    def canonical(self) -> Canonical:
        """The kernels' layout (a short last group is padded with codes that meet zero activations)."""
        groups = torch.arange(self.codes.shape[1]) // self.group_size
        return build(self.codes, groups, self.scales, self.zeros, QTYPE_U4)


def quantize_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> GroupCodes:
    """[N, K] -> 4-bit codes with a scale and zero point per (group of input columns, output row)."""
    w = weight.detach().float().cpu()
    n, k = w.shape
    pad = -k % group_size
    # padding repeats each row's last column: it widens no group's range
    padded = torch.cat([w, w[:, -1:].expand(n, pad)], dim=1) if pad else w
    blocks = padded.view(n, -1, group_size)  # [N, G, group]
    lo, hi = blocks.amin(dim=2), blocks.amax(dim=2)  # [N, G]
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: codes 0, w = min
    codes = torch.round((blocks - lo[..., None]) / scale[..., None]).clamp(0, 15)
    zero = -lo / scale
    codes = codes.view(n, -1)[:, :k].to(torch.uint8).contiguous()
    return GroupCodes(codes, scale.t().contiguous(), zero.t().contiguous(), group_size)


class Int4LinearMethod(QuantLinearMethod):
    param_names = ("weight", "weight_scales", "weight_zeros")

    def create_weights(self, layer: Any) -> None:
        group = self.config.group_size
        k, n = layer.in_per_rank, layer.out_per_rank
        groups = num_groups(layer.input_shard()[2], group)  # every group, also on a row shard
        weight = add_param(layer, "weight", (n, k), torch.uint8, ShardDims(0, 1))
        for name in ("weight_scales", "weight_zeros"):
            # not in the checkpoint: buffers, so no loader expects a tensor for them
            buf = torch.zeros(groups, n, dtype=torch.float32)
            buf.shard_dims = ShardDims(1, None)  # type: ignore[attr-defined]
            layer.register_buffer(name, buf, persistent=False)

        def load_quantized(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            codes = quantize_groups(loaded, group)
            layer.load_sharded(param, codes.codes, shard_id)
            layer.load_sharded(layer.weight_scales, codes.scales, shard_id)
            layer.load_sharded(layer.weight_zeros, codes.zeros, shard_id)

        weight.weight_loader = load_quantized  # type: ignore[attr-defined]

    def canonical(self, layer: Any) -> Canonical:
        groups = layer_groups(layer, self.config.group_size)
        return build(
            layer.weight.cpu(), groups, layer.weight_scales.cpu(), layer.weight_zeros.cpu(), QTYPE_U4
        )
