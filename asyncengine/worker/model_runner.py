"""ModelRunner: prepares one step's inputs from the persistent batch and runs this worker's model shard.

It never communicates with other processes: the Worker receives intermediate tensors for it and sends
what it returns. `execute_model` returns IntermediateTensors on every stage but the last, which
computes logits and samples.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from asyncengine.config import EngineConfig
from asyncengine.cpu import gemm as cpu_gemm
from asyncengine.cpu.kernel_graph import KernelGraphRunner, kernel_graphs_apply
from asyncengine.cpu.malloc import keep_freed_memory
from asyncengine.cpu.prefault import Prefaulter, anonymous_buffer, huge_pages_enabled
from asyncengine.cpu.prefault import enabled as prefault_enabled
from asyncengine.cuda.graph_runner import GraphRunner, ModelInputs
from asyncengine.layers.attention import Attention, AttentionMetadata, SampledRows, forward_context
from asyncengine.layers.grammar_mask import apply_token_bitmask_, bitmask_from_bytes
from asyncengine.layers.parallel import IntermediateTensors, ParallelContext
from asyncengine.layers.sampler import Sampler, SamplerOutput, SamplingRow
from asyncengine.models.loader import load_model
from asyncengine.worker.input_batch import SeqState, StepBatch


def mask_logits(
    logits: torch.Tensor, sampling_seqs: list[SeqState], seq_ids: list[int], bitmask: bytes
) -> None:
    """Structured output: -inf on the logits row of each masked sequence wherever its grammar disallows
    the token (a constrained sequence samples one row: it never carries drafts)."""
    row_of = {state.seq_id: i for i, state in enumerate(sampling_seqs)}
    present = [(row_of[s], k) for k, s in enumerate(seq_ids) if s in row_of]
    if not present:
        return
    masks = bitmask_from_bytes(bitmask, len(seq_ids))  # [len(seq_ids), words]
    rows = [r for r, _ in present]
    apply_token_bitmask_(logits, masks[[k for _, k in present]], rows)


def zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, huge_pages: bool = False
) -> torch.Tensor:
    """A zero-filled tensor; on CPU over an anonymous mmap, whose pages the OS zero-fills on first touch.

    torch.zeros writes every byte up front: ~1 s for the default 4 GiB CPU KV cache, most of a tiny
    model's start-up. Reads of never-written slots still see zeros (masked-out keys must be finite).
    The pages are then faulted in by a low-priority thread (cpu/prefault.py) while the engine idles;
    `huge_pages` maps them as transparent huge pages (see there)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if not count:
        return torch.zeros(shape, dtype=dtype)
    buffer = anonymous_buffer(count * torch.empty((), dtype=dtype).element_size(), huge_pages)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # the tensor keeps the mmap alive


class ModelInput(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] rows whose hidden state is sampled from
    sampling_rows: list[SamplingRow]
    sampling_seqs: list[SeqState]  # the sequences of sampling_rows, in the same order


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        parallel: ParallelContext,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        progress: bool = False,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.parallel = parallel
        self.device = device
        self.dtype = dtype
        self.kv_dtype = torch.float8_e5m2 if config.kv_cache_dtype == "fp8_e5m2" else dtype
        self.block_size = config.block_size
        self.model: nn.Module = load_model(
            config.model,
            parallel,
            dtype,
            device,
            progress=progress,
            quantization=config.quantization,
            lm_head_quantization=config.lm_head_quantization,
        )
        if device.type == "cpu":
            cpu_gemm.prepack_model(self.model)  # weights in oneDNN's layout: no re-packing per GEMM
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler(config.seed, device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graph_runner: GraphRunner | None = None
        self.prefaulter: Prefaulter | None = None  # the CPU cache's pages, faulted in after start-up
        self._decode_meta: AttentionMetadata | None = None  # host facts of the decode step being run

    # -- KV cache ---------------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * elem for a in self.attention_layers)

    def init_cache(self, num_blocks: int) -> None:
        """Allocates every layer's cache, plus one scratch block that padding rows write into."""
        self.kv_caches = []
        huge = huge_pages_enabled()  # opt-in, a prefaulted cache only (cpu/prefault.py); zeros: CPU only
        for layer in self.attention_layers:
            shape = (num_blocks + 1, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = zeros(shape, self.kv_dtype, self.device, huge)
            layer.v_cache = zeros(shape, self.kv_dtype, self.device, huge)
            self.kv_caches.append((layer.k_cache, layer.v_cache))
        if self.prefaulter is not None:
            self.prefaulter.close()
            self.prefaulter = None
        if self.device.type == "cpu" and prefault_enabled():
            self.prefaulter = Prefaulter([t for pair in self.kv_caches for t in pair])
            self.prefaulter.start()
        if self.device.type == "cpu":
            keep_freed_memory()  # the model is loaded: from here on, steps reuse their activations' pages
        # Decode steps of the first stage go through the GraphRunner on a GPU (CUDA graphs; eager on
        # padded static buffers with enforce_eager). Later stages receive their input from the previous
        # stage and run eagerly (see docs/architecture.md). On a CPU with the C kernels a single-rank,
        # single-stage worker replays kernel graphs (cpu/kernel_graph.py), padded to one of a few
        # sizes. (A pipeline stage's output leaves the process while the next step may already
        # overwrite the captured buffers, and collectives are not replayed: those run eagerly.)
        max_blocks = -(-self.max_model_len // self.block_size)
        single = self.parallel.is_first_stage and self.parallel.is_last_stage and self.parallel.tp_size == 1
        # With speculation most steps carry drafts (not decode-only): captures would rarely pay back
        # (offline mixed run with 4 n-gram drafts: 9.8 s without graphs, 10.0 s with).
        speculative = self.config.num_speculative_tokens > 0
        if (
            single
            and not speculative
            and self.device.type == "cpu"
            and not self.config.enforce_eager
            and kernel_graphs_apply()
        ):
            kv_bytes = sum(t.numel() * t.element_size() for pair in self.kv_caches for t in pair)
            self.graph_runner = KernelGraphRunner(
                self._decode_forward,
                max_num_seqs=self.config.max_num_seqs,
                max_blocks_per_seq=max_blocks,
                pad_slot_id=num_blocks * self.block_size,
                # the graphs' activations, up to a quarter of the cache's memory (at least 256 MiB)
                max_graph_bytes=max(kv_bytes // 4, 256 << 20),
            )
        elif self.parallel.is_first_stage and self.device.type == "cuda":
            self.graph_runner = GraphRunner(
                self._decode_forward,
                max_num_seqs=self.config.max_num_seqs,
                max_blocks_per_seq=max_blocks,
                device=self.device,
                cuda_graph_sizes=self.config.cuda_graph_sizes,
                enforce_eager=self.config.enforce_eager,
                pad_slot_id=num_blocks * self.block_size,
            )

    def capture_graphs(self) -> None:
        if self.graph_runner is not None:
            self.graph_runner.capture()

    def close(self) -> None:
        if self.prefaulter is not None:
            self.prefaulter.close()
        # NOTE: graphs go before the process groups do (the worker destroys those after this)
        if self.graph_runner is not None:
            self.graph_runner.close()

    def _decode_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> torch.Tensor | IntermediateTensors:
        """The forward the GraphRunner captures / runs on its (padded) static buffers."""
        n = input_ids.shape[0]
        host = self._decode_meta
        seq_lens_cpu = list(host.seq_lens_cpu) if host is not None else []
        seq_lens_cpu += [0] * (n - len(seq_lens_cpu))  # padding rows attend over nothing
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_lens_cpu=[1] * n,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=1,
            max_seq_len=max(host.max_seq_len if host is not None else 1, 1),
        )
        with forward_context(meta):
            return self.model(input_ids, positions, None)

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
        sampling_seqs: list[SeqState] = []
        sampled_lens: dict[int, int] = {}  # batch index -> rows sampled (its last ones), where any are
        max_blocks = 1
        offset = 0
        for b, (state, num, drafts) in enumerate(zip(batch.seqs, batch.num_scheduled, batch.num_drafts)):
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
                # (and one after each draft, which the engine compares with the drafts: spec_decode.py)
                row = SamplingRow(
                    state.sampling,
                    state.generator,
                    state.token_ids,
                    state.output_counts,
                    state.num_output_tokens,
                    state.penalties,
                )
                for i in range(offset - 1 - drafts, offset):
                    logits_indices.append(i)
                    rows.append(row)
                    sampling_seqs.append(state)
                sampled_lens[b] = drafts + 1
        tables = np.zeros((len(batch.seqs), max_blocks), dtype=np.int32)
        for i, state in enumerate(batch.seqs):
            tables[i, : len(state.block_ids)] = state.block_ids
        dev = self.device
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        slot_mapping = np.concatenate(slot_parts)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(query_start).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        if len(logits_indices) < offset and self.model.cuts_to_sampled_rows:
            meta.sampled = self._sampled_rows(logits_indices, sampled_lens, seq_lens, tables, slot_mapping)
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampling_rows=rows,
            sampling_seqs=sampling_seqs,
        )

    def _sampled_rows(
        self,
        logits_indices: list[int],  # each sampling sequence's last rows, in batch order
        sampled_lens: dict[int, int],  # batch index of each sampling sequence -> its sampled rows
        seq_lens: list[int],
        tables: np.ndarray,  # [B, max_blocks] int32
        slot_mapping: np.ndarray,  # [T] int64
    ) -> SampledRows:
        """The step's batch cut to the rows it samples from (AttentionMetadata.sampled)."""
        kept = list(sampled_lens)
        query_lens = list(sampled_lens.values())
        kept_lens = [seq_lens[i] for i in kept]
        starts = np.zeros(len(kept) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])
        indices = np.asarray(logits_indices, dtype=np.int64)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping[indices]).to(dev),
            query_start_loc=torch.from_numpy(starts).to(dev),
            seq_lens=torch.tensor(kept_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(tables[kept])).to(dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=kept_lens,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(kept_lens, default=0),
        )
        return SampledRows(torch.from_numpy(indices).to(dev), meta)

    # -- execution --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(
        self,
        model_input: ModelInput,
        intermediate: IntermediateTensors | None,
        sample: bool = True,
        grammar: tuple[list[int], bytes] | None = None,
    ) -> IntermediateTensors | SamplerOutput | None:
        """Runs the shard; on the last stage returns the sampled tokens (None where `sample` is False).
        `grammar`: (seq ids, packed bitmask rows) of the structured-output sequences, whose logits are
        masked to their grammars' allowed tokens before sampling."""
        meta = model_input.meta
        inputs = ModelInputs(
            model_input.input_ids,
            model_input.positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
        )
        if (
            self.graph_runner is not None
            and intermediate is None
            and self.graph_runner.uses_static_buffers(inputs)
        ):
            self._decode_meta = meta
            out = self.graph_runner.run(inputs)
        else:
            with forward_context(meta):
                out = self.model(model_input.input_ids, model_input.positions, intermediate)
        if not self.parallel.is_last_stage:
            return out
        if not model_input.sampling_rows:
            return SamplerOutput([], None) if sample else None
        # the model cut its last layer to the sampled rows already, where the step named them
        hidden = out if meta.sampled is not None else out[model_input.logits_indices]
        logits = self.model.compute_logits(hidden)  # [num_sampled, vocab]
        if not sample:  # other TP ranks join compute_logits' all-gather but leave sampling to rank 0
            return None
        if grammar is not None and grammar[0]:
            mask_logits(logits, model_input.sampling_seqs, *grammar)
        return self.sampler(logits, model_input.sampling_rows)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward at the full token budget with no cache bound: the activation peak for sizing."""
        budget = self.config.max_num_batched_tokens
        lens = [min(self.max_model_len, budget - i) for i in range(0, budget, self.max_model_len)]
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        query_start = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(budget, dtype=torch.long, device=self.device),
            query_start_loc=query_start.to(self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros((len(lens), 1), dtype=torch.int32, device=self.device),
            query_lens_cpu=lens,
            seq_lens_cpu=lens,
            max_query_len=max(lens),
            max_seq_len=max(lens),
        )
        intermediate = None
        if not self.parallel.is_first_stage:
            intermediate = {
                name: torch.zeros(budget, self.model.hidden_size, dtype=self.dtype, device=self.device)
                for name in self.model.intermediate_names
            }
        ids = torch.zeros(budget, dtype=torch.long, device=self.device)
        with forward_context(meta):
            out = self.model(ids, positions, intermediate)
        if self.parallel.is_last_stage:
            self.model.compute_logits(out[-min(budget, self.config.max_num_seqs) :])
