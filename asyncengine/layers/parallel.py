"""Where a model shard sits: its tensor-parallel rank and group, and its pipeline stage's layers.

Model code never talks to other stages; the only collectives inside a model are the tensor-parallel
all-reduce / all-gather of the layers in this file's helpers, within one stage's TP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

IntermediateTensors = dict[
    str, torch.Tensor
]  # what stage i hands to stage i + 1, e.g. hidden_states, residual


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layer_start: int = 0  # decoder layers [layer_start, layer_end) live on this stage
    layer_end: int = -1  # -1 = all layers (single stage)
    tp_group: Any = None  # torch.distributed ProcessGroup of this stage's TP ranks; None when tp_size == 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def owns_layer(self, index: int) -> bool:
        return self.layer_start <= index and (self.layer_end < 0 or index < self.layer_end)


def tp_all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    if ctx.tp_size == 1:
        return x
    dist.all_reduce(x, group=ctx.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, ctx: ParallelContext, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's shard along `dim` in rank order."""
    if ctx.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=ctx.tp_group)
    return torch.cat(parts, dim=dim)
