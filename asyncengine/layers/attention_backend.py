"""What an attention backend is given and must do: AttentionMetadata and the AttentionBackend protocol.

The bottom of the attention modules: the backends (attention_torch, attention_cpu, attention_triton)
import this and nothing above it; attention_selector picks one of them; the Attention layer
(attention.py) asks the selector. One direction, so no import needs to hide inside a function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened batch: sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; padding rows point at the scratch block
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    query_lens_cpu: list[int]  # same facts on the host, so the CPU backend loops without syncs
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """Computes attention of the batch's queries over the paged cache (new K/V already written)."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this step's keys (also in the cache)
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # W: a query at position i sees keys i - W < j <= i
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]
