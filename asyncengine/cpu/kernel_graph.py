"""Kernel graphs: CUDA-graph-style capture and replay of a CPU decode forward made of C kernel calls.

Why: a CPU decode step is ~100 calls into the C kernels (cpu/csrc) glued by Python (module calls,
shape checks, output allocation, ctypes argument conversion). Measured on the bench's medium model at
batch 1, the kernels take 8.7 ms of a 12.1 ms step; the other 3.4 ms is that glue, slowed further by
caches that the kernels' weight and KV streams have just flushed. A replay runs only the recorded
calls: no modules, no checks, no allocations.

Capture runs the forward once, as usual, while
* every function of the kernel libraries (build.loaded_libraries) is swapped for a proxy that
  records (function, arguments, return value) and calls through;
* a TorchDispatchMode sees every torch op: allocations and views need no replay (their addresses are
  what the kernels were given); any other op is recorded as a thunk that recomputes it into the tensor
  it produced; ops that would bake per-step data into the graph (tensor constants from Python data,
  reading a tensor into Python, random numbers) abort the capture (GraphUnsupported).
Every tensor the forward made is kept alive with the graph, so the recorded addresses stay valid.
Replay calls the recorded steps in order with the recorded arguments and checks each kernel's return
value against the captured one. Inputs must be in the same tensors as at capture (the GraphRunner's
static buffers); outputs are the captured tensors, overwritten by the next replay.

Valid because the forward's Python takes no data-dependent branch for a fixed batch shape: the
kernels make their data-dependent choices (row groups, segments, bad slots) in C, at replay time.

Runs of consecutive kernel calls are replayed by csrc/call_list.c in one ctypes call (cpu/call_list.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from asyncengine.cpu import amx as cpu_amx
from asyncengine.cpu.attention import load_kernel_library
from asyncengine.cpu.build import loaded_libraries
from asyncengine.cpu.call_list import KernelCall, call_list, load_call_list_library
from asyncengine.cpu.ops import load_ops_library
from asyncengine.cuda.graph_runner import ForwardFn, GraphRunner, ModelInputs

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
# allocations: their contents are whatever the recorded steps write into them
_ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default}
# ops whose result would be per-step data frozen into the graph
_REJECTED = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default, _aten._local_scalar_dense.default}
MAX_TORCH_OPS = 16  # beyond this many recorded torch ops a replay saves little over the eager forward


def kernel_graphs_apply() -> bool:
    """CPU decode steps are worth capturing where the C kernels load; ASYNCENGINE_KERNEL_GRAPHS=0 turns
    capture off (A/B), as does enforce_eager."""
    if os.environ.get("ASYNCENGINE_KERNEL_GRAPHS", "1") == "0":
        return False
    return load_kernel_library() is not None and load_ops_library() is not None


class GraphUnsupported(RuntimeError):
    """The forward did something a replay cannot repeat faithfully."""


class KernelGraph:
    """The recorded steps of one forward, the tensors they touch, and the forward's output."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], None]] = []
        self.num_steps = 0  # steps after call lists replaced runs of kernel calls
        self.num_kernel_calls = 0
        self.num_torch_ops = 0
        self.keepalive: list[torch.Tensor] = []
        self.output: Any = None
        self.nbytes = 0  # memory of the tensors the forward made (kept alive with the graph)

    @classmethod
    def capture(cls, forward: Callable[[], Any]) -> KernelGraph:
        """Runs `forward()` once, recording it; raises GraphUnsupported (after the forward's side effects
        so far) when it cannot be replayed."""
        for _ in range(2):  # a second time where the first met a kernel function new to this process
            graph = cls()
            with _recording_kernels(graph) as kernels, _Recorder(graph):
                graph.output = forward()
            if not kernels.missed:
                break
        else:
            raise GraphUnsupported("a kernel function was looked up for the first time during capture, twice")
        graph._gather_call_lists()
        graph.nbytes = sum(dict(_memory(t) for t in graph.keepalive).values())
        return graph

    def replay(self) -> Any:
        for step in self.steps:
            step()
        return self.output

    def _record_kernel(self, fn: Any, args: tuple[Any, ...], result: Any) -> None:
        self.steps.append(KernelCall(fn, args, result))
        self.num_kernel_calls += 1

    def _gather_call_lists(self) -> None:
        """Each run of kernel calls between torch ops becomes one call_list.c step, where that applies."""
        lib = load_call_list_library()
        if lib is None:
            self.num_steps = len(self.steps)
            return
        steps: list[Callable[[], None]] = []
        run: list[KernelCall] = []
        for step in [*self.steps, None]:
            if isinstance(step, KernelCall) and step.as_call() is not None:
                run.append(step)
                continue
            if run:
                steps.append(call_list(run, lib) if len(run) > 1 else run[0])
                run = []
            if step is not None:
                steps.append(step)
        self.steps = steps
        self.num_steps = len(steps)

    def _record_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if func._schema.is_mutable:  # in place (or out=): repeating the call repeats the effect
            self.steps.append(lambda: func(*args, **kwargs))
        else:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]

            def recompute() -> None:
                fresh = [t for t in tree_flatten(func(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
                for dst, src in zip(outs, fresh, strict=True):
                    dst.copy_(src)

            self.steps.append(recompute)
        self.num_torch_ops += 1
        if self.num_torch_ops > MAX_TORCH_OPS:
            raise GraphUnsupported(f"more than {MAX_TORCH_OPS} torch ops in the forward (last: {func})")


def _memory(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the memory under `t`: its storage's, shared by its views; an opaque tensor (oneDNN's
    blocked layouts) has no storage to ask, and counts its elements."""
    if t.layout == torch.strided and not t.is_mkldnn:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    return id(t), t.numel() * t.element_size()


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: KernelGraph) -> None:
        super().__init__()
        self.graph = graph

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False: torch leaves __torch_dispatch__ unwrapped. Its dynamo-disable wrapper imports torch._dynamo
        # at the first dispatched op, a 1.1-1.4 s stall of the first decode step on a 2-core CPU; a capture
        # never runs under torch.compile, so the wrapper guards nothing here.
        return False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _REJECTED or torch.Tag.nondeterministic_seeded in func.tags:
            raise GraphUnsupported(f"{func} cannot be replayed")
        out = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            self.graph.keepalive.append(out)
        elif not (func.is_view and _aliases_input(out, args)):
            tree_map(
                lambda t: self.graph.keepalive.append(t) if isinstance(t, torch.Tensor) else None,
                (args, kwargs, out),
            )
            self.graph._record_op(func, args, kwargs, out)
        # a view needs nothing: its memory is its input's, which is kept or lives outside the forward
        return out


def _aliases_input(out: Any, args: tuple[Any, ...]) -> bool:
    """The (first) output shares memory with a positional input. (The schema's view flag is not enough:
    aten.to.dtype is flagged a view yet returns a converted copy when the dtype differs.)"""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(first, torch.Tensor) or first.layout != torch.strided:
        return False
    ptr = first.untyped_storage().data_ptr()
    return any(
        isinstance(a, torch.Tensor)
        and a.layout == torch.strided
        and not a.is_mkldnn
        and a.untyped_storage().data_ptr() == ptr
        for a in args
    )


class _RecordingCall:
    """Stands in for a ctypes function while a graph is captured."""

    def __init__(self, fn: Any, graph: KernelGraph) -> None:
        self.fn, self.graph = fn, graph
        self.__name__ = getattr(fn, "__name__", "kernel")

    def __call__(self, *args: Any) -> Any:
        result = self.fn(*args)
        self.graph._record_kernel(self.fn, args, result)
        return result


class _recording_kernels:
    """Swaps every loaded kernel function for a _RecordingCall for the duration of the block. A function
    ctypes looks up for the first time inside the block (or a library loaded there) is not swapped, so
    its calls go unrecorded and a replay would skip them: `missed` says whether that happened (the first
    float32 decode capture once ran its GEMMs through a library object first made during the capture, and
    its replays returned another model's logits)."""

    def __init__(self, graph: KernelGraph) -> None:
        self.graph = graph
        self.saved: list[tuple[ctypes.CDLL, str, Any]] = []
        self.missed = False

    def __enter__(self) -> _recording_kernels:
        for lib in loaded_libraries():
            for name, fn in list(vars(lib).items()):
                if isinstance(fn, ctypes._CFuncPtr):  # ctypes caches looked-up functions on the instance
                    self.saved.append((lib, name, fn))
                    setattr(lib, name, _RecordingCall(fn, self.graph))
        return self

    def __exit__(self, *exc: object) -> None:
        swapped = {(id(lib), name) for lib, name, _ in self.saved}
        for lib, name, fn in self.saved:
            setattr(lib, name, fn)
        self.missed = any(
            isinstance(fn, ctypes._CFuncPtr) and (id(lib), name) not in swapped
            for lib in loaded_libraries()
            for name, fn in vars(lib).items()
        )


def kernel_graph_sizes(max_num_seqs: int, step: int = 16) -> list[int]:
    """1, 2, 4, 8, then multiples of `step` (and max_num_seqs): few sizes mean few captures (each costs
    ~20 ms of Python over its step). With AMX every GEMM computes whole 16-row tiles, so rows padded up to
    a multiple of 16 cost little (step 16); without it (AVX-512 GEMMs, the quantized kernels) a GEMM's
    time grows with its rows (step 8). Small batches run at their own size: one sequence padded to 16
    rows made an int8 batch-1 step twice as slow on an AMX-less CPU."""
    small = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    return sorted({*small, *range(16, max_num_seqs + 1, step), max_num_seqs})


class KernelGraphRunner(GraphRunner):
    """The GraphRunner for CPU workers: decode batches are padded to a kernel_graph_sizes() size in the
    static buffers (GraphRunner.run), captured as a KernelGraph on the first step at that size and
    replayed after that.
    Graphs are kept, least recently used evicted first, while the activations they keep alive (every
    tensor of a forward, all layers': 0.26 MB a row on the bench's 100M model, more on a wider one) fit in
    `max_graph_bytes`; the newest one always stays. A cap by count (8 graphs, before) held whatever 8
    graphs cost on a large model, and on a small one made a batch that shrinks from 256 sequences to 1 (20
    sizes) capture every size again on each pass (a capture costs 1.5-2.5x its replay; 256 requests of
    16-128 tokens: 9.45-9.62 s a run before, 9.26-9.49 s with the budget, within this VM's noise). If a
    capture fails, decode steps run eagerly from then on, unpadded (the ModelRunner asks
    uses_static_buffers)."""

    def __init__(
        self,
        forward: ForwardFn,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        pad_slot_id: int,
        max_graph_bytes: int = 1 << 30,
    ) -> None:
        super().__init__(
            forward,
            max_num_seqs,
            max_blocks_per_seq,
            "cpu",
            cuda_graph_sizes=kernel_graph_sizes(max_num_seqs, 16 if cpu_amx.available() else 8),
            pad_slot_id=pad_slot_id,
        )
        self.max_graph_bytes = max_graph_bytes
        self.kernel_graphs: OrderedDict[int, KernelGraph] = OrderedDict()
        self.enabled = True
        self.num_captures = 0

    def uses_static_buffers(self, inputs: ModelInputs) -> bool:
        # once a capture has failed, decode runs eagerly at its own size: padding buys nothing then
        return self.enabled and super().uses_static_buffers(inputs)

    def capture(self) -> None:
        logger.info(
            "CPU decode steps are captured as kernel graphs on first use (kept while their activations fit "
            "in %.0f MiB)",
            self.max_graph_bytes / 2**20,
        )

    def _run_static(self, size: int) -> Any:
        if not self.enabled:
            return super()._run_static(size)
        graph = self.kernel_graphs.get(size)
        if graph is not None:
            self.kernel_graphs.move_to_end(size)
            return graph.replay()
        views = self._views[size]
        try:
            graph = KernelGraph.capture(lambda: self._forward(*views))
        except GraphUnsupported as e:
            # the forward stopped part-way; running it again repeats the same writes with the same values.
            # Expected where the linears are torch ops (float32, oneDNN), hence info, not a warning.
            logger.info("CPU decode steps run eagerly: %s", e)
            self.enabled = False
            return self._forward(*views)
        self.num_captures += 1
        self.kernel_graphs[size] = graph
        while len(self.kernel_graphs) > 1 and self.graph_bytes > self.max_graph_bytes:
            self.kernel_graphs.popitem(last=False)
        return graph.output

    @property
    def graph_bytes(self) -> int:
        return sum(g.nbytes for g in self.kernel_graphs.values())

    def close(self) -> None:
        self.kernel_graphs.clear()
        super().close()
