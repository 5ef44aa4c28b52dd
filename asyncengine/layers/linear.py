"""Linear layers split across tensor-parallel ranks (Megatron style), with loaders that cut each rank's part.

Every parameter carries `weight_loader(param, loaded_tensor, shard_id=None)`: it receives the full HF tensor
and copies this rank's slice into `param`. Column-parallel layers split the output dim, row-parallel layers
the input dim; a column layer followed by a row layer needs one all-reduce, done by the row layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.cpu import gemm as cpu_gemm
from asyncengine.errors import ModelLoadError
from asyncengine.layers.parallel import ParallelContext, tp_all_gather, tp_all_reduce

WeightLoader = Callable[[nn.Parameter, torch.Tensor, Any], None]


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ModelLoadError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelLoadError(
            f"shape mismatch: parameter expects {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}"
        )
    dst.copy_(src)  # copy_ also moves to the parameter's device and casts to its dtype


def check_dim(loaded: torch.Tensor, dim: int, expected: int) -> None:
    """A TP slice of a wrong-sized tensor would load silently; compare the full size first."""
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        raise ModelLoadError(
            f"shape mismatch: expected size {expected} in dim {dim}, checkpoint has {tuple(loaded.shape)}"
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """For replicated parameters (norms, position embeddings): the whole tensor, shape checked."""
    copy_checked(param.data, loaded)


def load_into(param: nn.Parameter, name: str, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Runs the parameter's own loader and names the checkpoint tensor in any error."""
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    try:
        with torch.no_grad():
            loader(param, loaded, shard_id)
    except (ModelLoadError, RuntimeError, IndexError) as e:
        raise ModelLoadError(f"{name}: {e}") from e


class _ParallelLinear(nn.Module):
    """y = x W^T + b with this rank's [out_per_rank, in_per_rank] share of W."""

    def __init__(self, in_per_rank: int, out_per_rank: int, bias: bool, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.in_per_rank, self.out_per_rank = in_per_rank, out_per_rank
        self.weight = nn.Parameter(torch.empty(out_per_rank, in_per_rank), requires_grad=False)
        self.packed: cpu_gemm.PackedWeight | None = None  # the weight packed for CPU GEMMs (cpu/gemm.py)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        raise NotImplementedError

    def prepack(self, gated: bool = False) -> bool:
        """Swaps the weight for its packed copy (cpu_gemm.prepack) where that applies (CPU, after loading).
        gated: a merged [gate | up] weight whose GEMM is to return silu(gate) * up (cpu_gemm.prepack_gated);
        its module asks for that first, and the plain packing then keeps it."""
        if self.packed is not None:
            return True
        self.packed = cpu_gemm.prepack_gated(self.weight) if gated else cpu_gemm.prepack(self.weight)
        if self.packed is not None:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)  # the packed copy is the only one
        return self.packed is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.packed is not None:
            return cpu_gemm.linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_per_rank={self.in_per_rank}, out_per_rank={self.out_per_rank}, "
            f"bias={self.bias is not None}, tp={self.parallel.tp_size}, packed={self.packed is not None}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """Output features split across ranks; each rank returns its slice unless gather_output."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelContext,
        bias: bool = False,
        gather_output: bool = False,
    ) -> None:
        super().__init__(input_size, divide(output_size, parallel.tp_size, "output size"), bias, parallel)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        size = param.shape[0]
        check_dim(loaded, 0, size * self.parallel.tp_size)
        copy_checked(param.data, loaded.narrow(0, self.parallel.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out / tp] (or [T, out] gathered)
        y = self.matmul(x, self.bias)
        return tp_all_gather(y, self.parallel) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul, e.g. Llama's gate_proj | up_proj.

    Each rank holds [its slice of output 0 | its slice of output 1 | ...], so the fused output splits
    locally without communication. shard_id is the index into `output_sizes`.
    """

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], parallel: ParallelContext, bias: bool = False
    ):
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, parallel.tp_size, "merged output size")
        super().__init__(input_size, sum(self.output_sizes), parallel, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:  # the checkpoint already stores the fused tensor
            for i, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        tp = self.parallel.tp_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        check_dim(loaded, 0, self.output_sizes[shard_id])
        copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, self.parallel.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; shard_id is "q", "k" or "v" (None: the checkpoint's fused [q; k; v]).

    Query heads split evenly across ranks. KV heads split too while there are at least tp_size of them;
    with fewer (GQA/MQA at high TP) each KV head is replicated on tp_size // num_kv_heads ranks, because
    a rank's query heads need their KV head locally.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        parallel: ParallelContext,
        bias: bool = False,
    ) -> None:
        tp = parallel.tp_size
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            if tp % total_num_kv_heads:
                raise ModelLoadError(
                    f"tensor_parallel_size ({tp}) must be a multiple of num_key_value_heads "
                    f"({total_num_kv_heads})"
                )
            self.num_kv_heads = 1
            self.kv_replicas = tp // total_num_kv_heads
        self.q_size = self.num_heads * head_dim  # per rank
        self.kv_size = self.num_kv_heads * head_dim
        out_total = (self.q_size + 2 * self.kv_size) * tp  # what the base class divides back by tp
        super().__init__(hidden_size, out_total, parallel, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            total_kv = self.total_num_kv_heads * self.head_dim
            sizes = [self.total_num_heads * self.head_dim, total_kv, total_kv]
            for sid, part in zip(("q", "k", "v"), loaded.split(sizes, dim=0), strict=True):
                self.weight_loader(param, part, sid)
            return
        rank = self.parallel.tp_rank
        if shard_id == "q":
            offset, size, src_index = 0, self.q_size, rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, src_index = self.kv_size, rank // self.kv_replicas
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        total_heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_dim(loaded, 0, total_heads * self.head_dim)
        copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, src_index * size, size))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [T, q + 2 kv] -> [T, q], [T, kv], [T, kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(_ParallelLinear):
    """Input features split across ranks; partial sums are all-reduced, then the bias is added once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelContext,
        bias: bool = False,
    ) -> None:
        super().__init__(divide(input_size, parallel.tp_size, "input size"), output_size, bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if param.dim() == 1:  # the bias is replicated
            copy_checked(param.data, loaded)
            return
        size = param.shape[1]
        check_dim(loaded, 1, size * self.parallel.tp_size)
        copy_checked(param.data, loaded.narrow(1, self.parallel.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        if self.parallel.tp_size == 1:
            return self.matmul(x, self.bias)  # one fused op
        y = tp_all_reduce(self.matmul(x, None), self.parallel)
        return y + self.bias if self.bias is not None else y
