"""Linear layers split across tensor-parallel ranks (Megatron style), with loaders that cut each rank's part.

Every parameter carries `weight_loader(param, loaded_tensor, shard_id=None)`: it receives the full HF tensor
and copies this rank's slice into `param`. Column-parallel layers split the output dim, row-parallel layers
the input dim; a column layer followed by a row layer needs one all-reduce, done by the row layer.

A layer built inside quantization.context.building_with(method) holds the method's checkpoint tensors
instead of `weight` (quantized codes, scales, ...), each cut by `load_sharded` from the same shard
geometry (`output_shard`, `input_shard`) that the plain loaders use; after loading, the method turns them
into its kernel's weight and runs the GEMM.
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
from asyncengine.quantization.context import current_method

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
        self.packed: cpu_gemm.PackedWeight | None = None  # the weight packed for CPU GEMMs (cpu/gemm.py)
        self.quant_method = current_method()  # set while a quantized checkpoint's model is built
        self.quant_weight: Any = None  # the method's kernel weight, once loaded
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(out_per_rank, in_per_rank), requires_grad=False)
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.quant_method.create_weights(self)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        raise NotImplementedError

    def output_shard(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        """Along the output features, for checkpoint tensor `shard_id`: (offset in this rank's output,
        offset in the checkpoint tensor, size, the checkpoint tensor's full size). Unsplit here."""
        return 0, 0, self.out_per_rank, self.out_per_rank

    def input_shard(self) -> tuple[int, int, int]:
        """Along the input features: (offset in the checkpoint tensor, size, full size). Unsplit here."""
        return 0, self.in_per_rank, self.in_per_rank

    def load_sharded(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """The loader of a quantized layer's tensors: `param.shard_dims` (quantization.method.ShardDims)
        says which dims run along the output and input features, and how many features an element packs."""
        dims = param.shard_dims  # type: ignore[attr-defined]
        dst = param.data
        if dims.out_dim is not None:
            offset, start, size, full = self.output_shard(shard_id)
            if any(v % dims.out_pack for v in (offset, start, size)):
                raise ModelLoadError(
                    f"an output shard of {size} is not aligned to its packing ({dims.out_pack})"
                )
            check_dim(loaded, dims.out_dim, -(-full // dims.out_pack))
            loaded = loaded.narrow(dims.out_dim, start // dims.out_pack, size // dims.out_pack)
            dst = dst.narrow(dims.out_dim, offset // dims.out_pack, size // dims.out_pack)
        if dims.in_dim is not None:
            start, size, full = self.input_shard()
            if size != full and any(v % dims.in_pack for v in (start, size)):
                raise ModelLoadError(
                    f"an input shard of {size} is not aligned to its packing ({dims.in_pack})"
                )
            check_dim(loaded, dims.in_dim, -(-full // dims.in_pack))
            loaded = loaded.narrow(dims.in_dim, start // dims.in_pack, -(-size // dims.in_pack))
        copy_checked(dst, loaded)

    def process_weights_after_loading(self) -> None:
        """A quantized layer's checkpoint tensors become its kernel's weight (no-op for plain ones)."""
        if self.quant_method is not None and self.quant_weight is None:
            self.quant_method.process_after_loading(self)

    def prepack(self, gated: bool = False) -> bool:
        """Swaps the weight for its packed copy (cpu_gemm.prepack) where that applies (CPU, after loading).
        gated: a merged [gate | up] weight whose GEMM is to return silu(gate) * up (cpu_gemm.prepack_gated);
        its module asks for that first, and the plain packing then keeps it."""
        if self.packed is not None:
            return True
        if self.quant_method is not None:  # its kernel weight was made at load time
            return False
        self.packed = cpu_gemm.prepack_gated(self.weight) if gated else cpu_gemm.prepack(self.weight)
        if self.packed is not None:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)  # the packed copy is the only one
        return self.packed is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        if self.packed is not None:
            return cpu_gemm.linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_per_rank={self.in_per_rank}, out_per_rank={self.out_per_rank}, "
            f"bias={self.bias is not None}, tp={self.parallel.tp_size}, packed={self.packed is not None}"
            + (f", quantized={self.quant_method.config.method}" if self.quant_method is not None else "")
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

    def output_shard(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        size = self.out_per_rank
        return 0, self.parallel.tp_rank * size, size, size * self.parallel.tp_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        offset, start, size, full = self.output_shard(shard_id)
        check_dim(loaded, 0, full)
        copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))

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
        super().weight_loader(param, loaded, shard_id)

    def output_shard(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        if shard_id is None:
            raise ModelLoadError("a quantized fused gate/up tensor is not supported: store its parts")
        tp = self.parallel.tp_size
        size = self.output_sizes[shard_id] // tp
        return sum(self.output_sizes[:shard_id]) // tp, self.parallel.tp_rank * size, size, size * tp


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
        super().weight_loader(param, loaded, shard_id)

    def load_sharded(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        # a fused checkpoint tensor (GPT-2's c_attn, quantized or quantized while loading) is cut into its
        # q, k and v parts along the output features, each loaded as if stored apart
        dims = param.shard_dims  # type: ignore[attr-defined]
        if shard_id is None and dims.out_dim is not None:
            total_kv = self.total_num_kv_heads * self.head_dim
            sizes = [self.total_num_heads * self.head_dim, total_kv, total_kv]
            if any(size % dims.out_pack for size in sizes):
                raise ModelLoadError(f"a fused qkv part is not aligned to its packing ({dims.out_pack})")
            check_dim(loaded, dims.out_dim, sum(sizes) // dims.out_pack)
            parts = loaded.split([size // dims.out_pack for size in sizes], dim=dims.out_dim)
            for sid, part in zip(("q", "k", "v"), parts, strict=True):
                super().load_sharded(param, part, sid)
            return
        super().load_sharded(param, loaded, shard_id)

    def output_shard(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        rank = self.parallel.tp_rank
        if shard_id == "q":
            offset, size, src_index = 0, self.q_size, rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, src_index = self.kv_size, rank // self.kv_replicas
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        total_heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        return offset, src_index * size, size, total_heads * self.head_dim

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
        start, size, full = self.input_shard()
        check_dim(loaded, 1, full)
        copy_checked(param.data, loaded.narrow(1, start, size))

    def input_shard(self) -> tuple[int, int, int]:
        size = self.in_per_rank
        return self.parallel.tp_rank * size, size, size * self.parallel.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        if self.parallel.tp_size == 1:
            return self.matmul(x, self.bias)  # one fused op
        y = tp_all_reduce(self.matmul(x, None), self.parallel)
        return y + self.bias if self.bias is not None else y
