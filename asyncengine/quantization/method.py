"""What every quantized linear method shares: its checkpoint tensors as parameters that know how to
take their tensor-parallel share, the conversion to the canonical layout after loading, and the GEMM.

A method object is shared by every linear layer of a model (layers/linear.py calls it); what a layer
holds lives on the layer: its checkpoint parameters until loading ends, then `quant_weight`.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.quantization import kernels
from asyncengine.quantization.canonical import Canonical
from asyncengine.quantization.config import QuantConfig


class ShardDims(NamedTuple):
    """Where a checkpoint tensor's dims meet the layer's features, for its tensor-parallel share."""

    out_dim: int | None  # the dim along output features (None: the tensor has none)
    in_dim: int | None  # the dim along input features (None: not split, e.g. the groups of scales)
    out_pack: int = 1  # output features per element along out_dim (packed zero points)
    in_pack: int = 1  # input features per element along in_dim (packed codes)


def add_param(
    layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, dims: ShardDims, fill: int = 0
) -> nn.Parameter:
    """Registers a checkpoint tensor of `layer` that its `load_sharded` fills with this rank's share."""
    param = nn.Parameter(torch.full(shape, fill, dtype=dtype), requires_grad=False)
    param.shard_dims = dims  # type: ignore[attr-defined]
    param.weight_loader = layer.load_sharded  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def add_g_idx(layer: nn.Module, name: str) -> nn.Parameter:
    """An act-order g_idx: [K] int32 along the inputs, -1 until a checkpoint fills it (it may be absent).
    A fused layer (q/k/v, gate/up) reads one per part; they share the input, so GPTQ orders their columns
    alike, and one permutation serves the fused GEMM. Parts that disagree cannot, and are refused."""
    param = add_param(layer, name, (layer.in_per_rank,), torch.int32, ShardDims(None, 0), fill=-1)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        before = param.data.clone()
        layer.load_sharded(param, loaded, shard_id)
        if bool((before >= 0).any()) and not torch.equal(before, param.data):
            raise ModelLoadError(f"the fused parts of this layer have different {name} (act-order)")

    param.weight_loader = load  # type: ignore[attr-defined]
    return param


def divided(total: int, by: int, what: str) -> int:
    if total % by:
        raise ModelLoadError(f"{what} ({total}) is not a multiple of {by}, which the packed format needs")
    return total // by


def num_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


def layer_groups(layer: Any, group_size: int) -> torch.Tensor:
    """[K_local] int64: the group of each of this rank's input columns, counted over the full input."""
    start, size, _ = layer.input_shard()
    if group_size == -1:
        return torch.zeros(size, dtype=torch.int64)
    return (start + torch.arange(size)) // group_size


class QuantLinearMethod:
    """One quantization format's linear layers. Subclasses name their checkpoint tensors, create them
    (`create_weights`) and read them back as the canonical layout (`canonical`)."""

    param_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    def create_weights(self, layer: Any) -> None:
        raise NotImplementedError

    def canonical(self, layer: Any) -> Canonical:
        raise NotImplementedError

    def optional(self, name: str) -> bool:
        """Whether a checkpoint may leave the parameter out (GPTQ's g_idx)."""
        return False

    def process_after_loading(self, layer: Any) -> None:
        """Replaces the checkpoint tensors by the kernel's weight (quantization/kernels.py)."""
        device = next(getattr(layer, name) for name in self.param_names if hasattr(layer, name)).device
        with torch.no_grad():
            canon = self.canonical(layer)
        for name in self.param_names:
            if hasattr(layer, name):
                delattr(layer, name)
        layer.quant_weight = kernels.prepare(canon, device)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernels.linear(x, layer.quant_weight, bias)
