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
    # the rows the step samples from, where they are fewer than all (see SampledRows); None: every row
    sampled: SampledRows | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class SampledRows:
    """The rows of a step whose hidden states are sampled from (each sequence's last one, or its last
    1 + drafts), where they are fewer than the step's rows, as in every step with a prompt chunk.

    Only those rows' outputs of the last decoder layer are ever read, so a model may cut the batch to them
    in that layer once its keys and values are in the cache: attention for these queries only, then
    o_proj, the MLP and the final norm on N rows instead of T (a prompt's other rows need only their K/V).
    Each sequence's sampled rows are the last of its query rows, so `meta` is the same batch with every
    sequence's queries cut to that suffix (sequences that sample nothing dropped): its attention reads the
    sequence's keys, this step's included, from the cache."""

    indices: torch.Tensor  # [N] int64: the rows, in the order logits are computed
    meta: AttentionMetadata  # the batch of those N query rows

    def __len__(self) -> int:
        return self.indices.shape[0]


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
