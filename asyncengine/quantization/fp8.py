"""FP8 weight checkpoints (`quant_method: "fp8"`, e4m3), as the "-FP8" releases ship them.

Per linear layer: weight [N, K] float8_e4m3fn, and one of
  weight_scale     a scalar (per tensor; a fused q/k/v or gate/up layer gets one per part) or [N] / [N, 1]
                   (per output channel);
  weight_scale_inv [ceil(N / bn), ceil(K / bk)] with weight_block_size [bn, bk] (DeepSeek / Qwen3 -FP8):
                   one scale per block, multiplied like weight_scale despite the name.
w = float(weight) * scale. Activations are not quantized (an `input_scale` is not loaded): the GEMM runs
in the model dtype with the weights decoded in registers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine.quantization.canonical import QTYPE_FP8, Canonical, build
from asyncengine.quantization.method import QuantLinearMethod, ShardDims, add_param, layer_groups, num_groups


class FP8LinearMethod(QuantLinearMethod):
    param_names = ("weight", "weight_scale", "weight_scale_inv")

    def create_weights(self, layer: Any) -> None:
        k, n = layer.in_per_rank, layer.out_per_rank
        add_param(layer, "weight", (n, k), torch.float8_e4m3fn, ShardDims(0, 1))
        block = self.config.fp8_block
        if block is None:
            scale = add_param(layer, "weight_scale", (n,), torch.float32, ShardDims(0, None))
        else:
            groups = num_groups(layer.input_shard()[2], block[1])
            scale = add_param(layer, "weight_scale_inv", (n, groups), torch.float32, ShardDims(0, None))

        def load_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            # per-tensor and per-block scales become per-row ones of the checkpoint tensor's full height
            full = layer.output_shard(shard_id)[3]
            if block is None:
                loaded = loaded.reshape(-1).float()
                if loaded.numel() == 1:
                    loaded = loaded.expand(full)
            else:
                loaded = loaded.float().repeat_interleave(block[0], 0)[:full]
            layer.load_sharded(param, loaded, shard_id)

        scale.weight_loader = load_scale  # type: ignore[attr-defined]

    def canonical(self, layer: Any) -> Canonical:
        q = layer.weight.cpu().view(torch.uint8)  # [N, K] e4m3 bytes
        if self.config.fp8_block is None:
            scales = layer.weight_scale.cpu()[None, :]  # [1, N]
            groups = torch.zeros(layer.in_per_rank, dtype=torch.int64)
        else:
            scales = layer.weight_scale_inv.cpu().t()  # [G, N]
            groups = layer_groups(layer, self.config.fp8_block[1])
        return build(q, groups, scales, None, QTYPE_FP8)
