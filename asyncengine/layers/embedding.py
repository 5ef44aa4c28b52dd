"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.cpu import gemm as cpu_gemm
from asyncengine.cpu import ops as cpu_ops
from asyncengine.errors import ModelLoadError
from asyncengine.layers.parallel import ParallelContext, tp_all_gather, tp_all_reduce
from asyncengine.quantization import kernels
from asyncengine.quantization.int4 import quantize_groups
from asyncengine.quantization.int8 import int8_canonical, quantize_rows


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * per_rank, (r + 1) * per_rank) of the vocabulary.

    The vocabulary is padded up to a multiple of tp_size so every rank holds the same number of rows (the
    all-gather of the LM head needs equal shapes); padding rows are zero and never looked up.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.per_rank = -(-num_embeddings // parallel.tp_size)
        self.padded_num_embeddings = self.per_rank * parallel.tp_size
        self.vocab_start = parallel.tp_rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)  # real rows end here
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ModelLoadError(
                f"shape mismatch: embedding expects {(self.num_embeddings, self.embedding_dim)}, "
                f"checkpoint has {tuple(loaded.shape)}"
            )
        rows = max(0, self.vocab_end - self.vocab_start)
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_start + rows])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        if self.parallel.tp_size == 1:
            out = cpu_ops.gather_rows(self.weight, input_ids, self.weight.dtype)
            return out if out is not None else F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.per_rank)  # [T]
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        # every id is owned by exactly one rank: zero the others' rows and sum across ranks
        out = out.masked_fill(~mine.unsqueeze(-1), 0)
        return tp_all_reduce(out, self.parallel)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, per_rank={self.per_rank}, dim={self.embedding_dim}, "
            f"tp={self.parallel.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary; each rank computes its vocab slice, then all-gather."""

    packed: cpu_gemm.PackedWeight | None = None  # the weight packed for CPU GEMMs (cpu/gemm.py)
    quant_weight: Any = None  # quantization.kernels.KernelWeight once quantize() ran
    tied = False

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Shares the embedding's weight (tied word embeddings on a stage that holds both)."""
        self.weight = embedding.weight
        self.tied = True

    def quantize(self, method: str) -> None:
        """--lm-head-quantization: the logits GEMM reads codes through the quantized kernels (this rank's
        vocab rows; padding rows stay zero). int8: per-row scales; int4: a scale and zero point per row
        and 32 hidden columns (quantization/int4.py). A weight-only, load-time choice, as llama.cpp
        quantizes its output tensor: on a small model the head is a large share of a decode step's bytes.
        A tied weight stays for the embedding lookup too."""
        if method == "int8":
            canonical = int8_canonical(*quantize_rows(self.weight.data))
        elif method == "int4":
            canonical = quantize_groups(self.weight.data).canonical()
        else:
            raise ValueError(f"unknown LM head quantization {method!r}")
        self.quant_weight = kernels.prepare(canonical, self.weight.device)
        if not self.tied:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def prepack(self) -> bool:
        """Packs the weight for the logits GEMM; a tied weight stays for the embedding lookup too."""
        if self.quant_weight is not None:
            return False
        self.packed = cpu_gemm.prepack(self.weight)
        if self.packed is not None and not self.tied:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        return self.packed is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab], model dtype
        if self.quant_weight is not None:
            logits = kernels.linear(hidden, self.quant_weight, None)  # [N, per_rank]
        elif self.packed is not None:
            logits = cpu_gemm.linear(hidden, self.packed, None)  # [N, per_rank]
        else:
            logits = F.linear(hidden, self.weight)  # [N, per_rank]
        logits = tp_all_gather(logits, self.parallel, dim=-1)  # [N, padded vocab]
        return logits[:, : self.num_embeddings]  # the sampler widens to float32 where it needs to

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding lookup; call compute_logits")
