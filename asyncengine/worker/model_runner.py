"""ModelRunner: prepares one step's inputs from the persistent batch and runs this worker's model shard.

It never communicates with other processes: the Worker receives intermediate tensors for it and sends
what it returns. `execute_model` returns IntermediateTensors on every stage but the last, which
computes logits and samples.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from asyncengine.config import EngineConfig
from asyncengine.layers.attention import Attention, AttentionMetadata, forward_context
from asyncengine.layers.parallel import IntermediateTensors, ParallelContext
from asyncengine.layers.sampler import Sampler, SamplerOutput, SamplingRow
from asyncengine.models.loader import load_model
from asyncengine.worker.input_batch import StepBatch


class ModelInput(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] rows whose hidden state is sampled from
    sampling_rows: list[SamplingRow]


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelContext, device: torch.device,
                 dtype: torch.dtype, progress: bool = False) -> None:
        self.config = config
        self.parallel = parallel
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.model: nn.Module = load_model(config.model, parallel, dtype, device, progress=progress)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler(config.seed, device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # -- KV cache ---------------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * elem for a in self.attention_layers)

    def init_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.attention_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.kv_caches.append((layer.k_cache, layer.v_cache))

    # -- inputs -----------------------------------------------------------------------------------
    def prepare_model_input(self, batch: StepBatch) -> ModelInput:
        bs = self.block_size
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        rows: list[SamplingRow] = []
        max_blocks = 1
        offset = 0
        for state, num in zip(batch.seqs, batch.num_scheduled):
            start, end = state.num_computed_tokens, state.num_computed_tokens + num
            ids.extend(state.token_ids[start:end])
            positions = np.arange(start, end, dtype=np.int64)
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            pos_parts.append(positions)
            slot_parts.append(blocks[positions // bs] * bs + positions % bs)
            query_lens.append(num)
            seq_lens.append(end)
            max_blocks = max(max_blocks, len(state.block_ids))
            offset += num
            if end == len(state.token_ids):  # the prompt is fully computed: this step samples a token
                logits_indices.append(offset - 1)
                rows.append(SamplingRow(state.sampling, state.generator, state.token_ids, state.output_counts,
                                        state.num_output_tokens))
        tables = np.zeros((len(batch.seqs), max_blocks), dtype=np.int32)
        for i, state in enumerate(batch.seqs):
            tables[i, : len(state.block_ids)] = state.block_ids
        dev = self.device
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            query_start_loc=torch.from_numpy(query_start).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampling_rows=rows,
        )

    # -- execution --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, model_input: ModelInput, intermediate: IntermediateTensors | None,
                      sample: bool = True) -> IntermediateTensors | SamplerOutput | None:
        """Runs the shard; on the last stage returns the sampled tokens (None where `sample` is False)."""
        with forward_context(model_input.meta):
            out = self.model(model_input.input_ids, model_input.positions, intermediate)
        if not self.parallel.is_last_stage:
            return out
        if not model_input.sampling_rows:
            return SamplerOutput([], None) if sample else None
        logits = self.model.compute_logits(out[model_input.logits_indices])  # [num_sampled, vocab]
        if not sample:  # other TP ranks join compute_logits' all-gather but leave sampling to rank 0
            return None
        return self.sampler(logits, model_input.sampling_rows)
