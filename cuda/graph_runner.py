"""GraphRunner: replays decode steps from CUDA graphs captured at a few padded batch sizes.

Decode-only batches (one query token per sequence) are copied into static input buffers, padded up to
the nearest captured size and replayed; the output is sliced back to the real batch. Prefill, mixed
and oversized batches run the forward eagerly on the caller's own tensors. Without CUDA (or with
enforce_eager) the capture step is skipped but decode batches still go through the same padding and
static buffers, so padding, buffer reuse and slicing are exercised on every platform.

The runner knows nothing about models: it wraps any `forward(input_ids, positions, slot_mapping,
block_tables, seq_lens, query_start_loc) -> output` whose output rows are tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)

# Padding rows attend over nothing (the Triton decode kernel returns zeros for them, and torch's SDPA
# returns zeros for a fully masked row); together with slot -1 they neither write nor read the cache.
PAD_SEQ_LEN = 0


class ModelInputs(NamedTuple):
    """One flattened batch in the order the forward callable takes it: sequence i owns token rows
    query_start_loc[i]:query_start_loc[i+1]. Every sequence has at least one query token."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 = write nothing
    block_tables: torch.Tensor  # [B, M] int32, M <= max_blocks_per_seq
    seq_lens: torch.Tensor  # [B] int32, context after this step
    query_start_loc: torch.Tensor  # [B + 1] int32

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode_only(self) -> bool:
        # Shapes alone decide (no device sync): B sequences with >= 1 token each and B tokens in all.
        return self.num_tokens == self.num_seqs


ForwardFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any
]


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 from 16, and max_num_seqs itself so every decode batch has a graph."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 8))
    if max_num_seqs >= 1 and sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def _slice_rows(out: Any, n: int) -> Any:
    """First n token rows of a tensor, or of every tensor in a tuple/list/dict (e.g. hidden + residual)."""
    if isinstance(out, torch.Tensor):
        return out[:n]
    if isinstance(out, dict):
        return {key: _slice_rows(value, n) for key, value in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_slice_rows(value, n) for value in out)
    return out


class GraphRunner:
    """Runs one model forward per step, from a CUDA graph when the batch allows it.

    Usage: build it once the model and KV cache exist, call `capture()` once, then `run(inputs)` every
    step and `close()` at shutdown. Outputs of a replayed graph are views of static buffers that the
    next `run` overwrites: consume them (sample, send) before the next step.
    """

    def __init__(
        self,
        forward: ForwardFn,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device | str,
        cuda_graph_sizes: Sequence[int] | None = None,
        enforce_eager: bool = False,
        pad_slot_id: int = -1,
        num_warmups: int = 2,
    ) -> None:
        if max_num_seqs < 1 or max_blocks_per_seq < 1:
            raise ValueError(
                f"max_num_seqs ({max_num_seqs}) and max_blocks_per_seq ({max_blocks_per_seq}) must be >= 1"
            )
        sizes = default_capture_sizes(max_num_seqs) if cuda_graph_sizes is None else list(cuda_graph_sizes)
        if any(s < 1 for s in sizes):
            raise ValueError(f"cuda_graph_sizes must be positive, got {sizes}")
        self._forward = forward
        self.device = torch.device(device)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.pad_slot_id = pad_slot_id
        self.num_warmups = num_warmups
        # Sizes above max_num_seqs could never be used; dropping them saves capture time and memory.
        self.capture_sizes: list[int] = sorted({s for s in sizes if s <= max_num_seqs})
        self.max_capture_size = self.capture_sizes[-1] if self.capture_sizes else 0
        # _padded_size[b] = smallest capture size >= b: one list index per step instead of a search.
        self._padded_size: list[int] = [0] * (self.max_capture_size + 1)
        size_iter = iter(self.capture_sizes)
        size = next(size_iter, 0)
        for b in range(1, self.max_capture_size + 1):
            if b > size:
                size = next(size_iter)
            self._padded_size[b] = size
        self.use_cuda_graphs = (
            not enforce_eager
            and bool(self.capture_sizes)
            and self.device.type == "cuda"
            and torch.cuda.is_available()  # the CPU build's CUDAGraph raises
        )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Any] = {}
        self._pool: Any = None
        self.capture_memory_bytes = 0  # device memory the graphs took, for KV-cache sizing and logs
        self._buffers = self._allocate_buffers()
        # One set of views per size, made once: a replay reads exactly these addresses.
        self._views = {size: self._sliced(size) for size in self.capture_sizes}

    def _allocate_buffers(self) -> ModelInputs:
        n, device = self.max_capture_size, self.device
        # Plain tensors even if built under inference_mode: in-place copies into them must work anywhere.
        with torch.inference_mode(False):
            return ModelInputs(
                input_ids=torch.zeros(n, dtype=torch.int64, device=device),
                positions=torch.zeros(n, dtype=torch.int64, device=device),
                slot_mapping=torch.full((n,), self.pad_slot_id, dtype=torch.int64, device=device),
                block_tables=torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=device),
                seq_lens=torch.full((n,), PAD_SEQ_LEN, dtype=torch.int32, device=device),
                # Decode rows hold one token each, so query_start_loc is arange for every batch: set once.
                query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            )

    def _sliced(self, size: int) -> ModelInputs:
        b = self._buffers
        return ModelInputs(
            b.input_ids[:size],
            b.positions[:size],
            b.slot_mapping[:size],
            b.block_tables[:size],
            b.seq_lens[:size],
            b.query_start_loc[: size + 1],
        )

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a decode batch of num_seqs runs at, or None when it runs eagerly."""
        if 1 <= num_seqs <= self.max_capture_size:
            return self._padded_size[num_seqs]
        return None

    def uses_static_buffers(self, inputs: ModelInputs) -> bool:
        """True when `run` pads this batch into the static buffers (and replays a graph, if captured)."""
        return inputs.is_decode_only and self.padded_size(inputs.num_seqs) is not None

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures one graph per size, largest first, all sharing one memory pool.

        Call once, after weights are loaded and the KV cache is bound: graphs record tensor addresses.
        Without CUDA, or with enforce_eager, this only logs that capture is skipped.
        """
        if not self.use_cuda_graphs:
            logger.info(
                "CUDA graph capture skipped (%s); decode runs eagerly on padded static buffers",
                "no sizes" if not self.capture_sizes else f"device {self.device}, eager",
            )
            return
        if self._graphs:
            raise RuntimeError("GraphRunner.capture() called twice")
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        # Largest first: its intermediates size the shared pool, and the smaller graphs fit inside it.
        self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.capture_sizes):
            static = self._views[size]
            self._fill_padding(0, size)
            # Warm-up runs let lazy initialisation (cuBLAS handles, Triton compiles, autotuning) happen
            # outside the capture, where it is not allowed.
            for _ in range(self.num_warmups):
                self._forward(*static)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                output = self._forward(*static)
            self._graphs[size] = graph
            self._outputs[size] = output
        torch.cuda.synchronize(self.device)
        self.capture_memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info(
            "captured %d CUDA graphs (sizes %s) using %.1f MiB",
            len(self._graphs),
            self.capture_sizes,
            self.capture_memory_bytes / 2**20,
        )

    def run(self, inputs: ModelInputs) -> Any:
        """Runs the forward for one batch and returns its output rows for the real tokens only.

        Decode-only batches of at most `max_capture_size` sequences are copied into the static buffers,
        padded (padding rows: token 0, position 0, slot `pad_slot_id`, seq_len 0, block table row 0)
        and replayed, or run eagerly on those buffers when no graph exists. Everything else runs
        eagerly on `inputs` as given. NOTE: host-side inputs are copied with non_blocking=True; if they
        live in pinned memory, do not modify them until the step's stream work has finished.
        """
        num_seqs = inputs.num_seqs
        size = self.padded_size(num_seqs) if inputs.is_decode_only else None
        if size is None:
            return self._forward(*inputs)
        if inputs.block_tables.shape[1] > self.max_blocks_per_seq:
            raise ValueError(
                f"block table width {inputs.block_tables.shape[1]} > max_blocks_per_seq "
                f"{self.max_blocks_per_seq}"
            )
        self._copy_in(inputs)
        self._fill_padding(num_seqs, size)
        return _slice_rows(self._run_static(size), num_seqs)

    def _run_static(self, size: int) -> Any:
        """The forward on the static buffers at `size` (filled and padded): its graph, or eagerly."""
        graph = self._graphs.get(size)
        if graph is None:
            return self._forward(*self._views[size])
        graph.replay()
        return self._outputs[size]

    def _copy_in(self, inputs: ModelInputs) -> None:
        b, n, width = self._buffers, inputs.num_seqs, inputs.block_tables.shape[1]
        b.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        b.positions[:n].copy_(inputs.positions, non_blocking=True)
        b.slot_mapping[:n].copy_(inputs.slot_mapping, non_blocking=True)
        b.seq_lens[:n].copy_(inputs.seq_lens, non_blocking=True)
        # Columns past `width` keep stale block ids from earlier steps; kernels only read the
        # ceil(seq_len / block_size) <= width entries a sequence owns, so they are never used.
        b.block_tables[:n, :width].copy_(inputs.block_tables, non_blocking=True)

    def _fill_padding(self, start: int, stop: int) -> None:
        """Rows start..stop become padding that writes nothing (slot pad_slot_id) and reads nothing."""
        if start >= stop:
            return
        b = self._buffers
        b.input_ids[start:stop].zero_()
        b.positions[start:stop].zero_()
        b.slot_mapping[start:stop].fill_(self.pad_slot_id)
        b.seq_lens[start:stop].fill_(PAD_SEQ_LEN)
        b.block_tables[start:stop].zero_()

    def close(self) -> None:
        """Destroys the captured graphs and their memory pool. Idempotent.

        NOTE: call this before torch.distributed.destroy_process_group(): graphs captured with NCCL
        collectives keep references into the communicator, and tearing the communicator down first can
        hang or crash when the graphs are freed later (at garbage collection or interpreter exit).
        """
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()
        self._pool = None
