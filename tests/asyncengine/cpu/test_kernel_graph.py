"""CPU kernel graphs (cpu/kernel_graph.py): a replayed decode step gives the eager forward's bits."""

from __future__ import annotations

import random
import subprocess
import sys
from typing import Any

import pytest
import torch

from asyncengine.config import EngineConfig
from asyncengine.cpu import amx as cpu_amx
from asyncengine.cpu import quant_gemm
from asyncengine.cpu.kernel_graph import (
    GraphUnsupported,
    KernelGraph,
    KernelGraphRunner,
    kernel_graph_sizes,
    kernel_graphs_apply,
    load_call_list_library,
)
from asyncengine.cpu.ops import load_ops_library
from asyncengine.cuda.graph_runner import ModelInputs
from asyncengine.layers.attention import forward_context, set_attention_backend
from asyncengine.layers.attention_cpu import CpuAttentionBackend
from asyncengine.layers.parallel import ParallelContext
from asyncengine.transport.wire import SamplingOptions
from asyncengine.worker.input_batch import SeqState, StepBatch
from asyncengine.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not kernel_graphs_apply(), reason="no C kernels (no compiler)")


def make_runner(
    path: Any, max_num_seqs: int, max_len: int, num_blocks: int, dtype: str = "bfloat16"
) -> tuple[ModelRunner, KernelGraphRunner]:
    set_attention_backend(CpuAttentionBackend())
    # block_size 16: the tests lay out block tables of 16-token blocks themselves
    cfg = EngineConfig(model=str(path), dtype=dtype, max_num_seqs=max_num_seqs, block_size=16)
    runner = ModelRunner(cfg, ParallelContext(), torch.device("cpu"), getattr(torch, dtype), max_len)
    runner.init_cache(num_blocks)
    graphs = runner.graph_runner
    assert isinstance(graphs, KernelGraphRunner)
    return runner, graphs


def decode_inputs(runner: ModelRunner, seqs: list[SeqState], step: int) -> ModelInputs:
    mi = runner.prepare_model_input(StepBatch(step, seqs, [1] * len(seqs), [0] * len(seqs)))
    runner._decode_meta = mi.meta
    meta = mi.meta
    return ModelInputs(
        mi.input_ids, mi.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc
    )


@pytest.mark.parametrize(
    "arch,overrides,captured,dtype",
    [
        ("llama", {}, True, "bfloat16"),
        ("qwen2", {}, True, "bfloat16"),  # q/k/v biases
        ("mistral", {"sliding_window": 12}, True, "bfloat16"),  # windowed attention
        ("llama", {"num_key_value_heads": 1, "hidden_size": 128}, True, "bfloat16"),  # GQA 4:1
        # q/k norms over each head of the qkv slice in one C call each (RMSNorm.per_head)
        ("qwen3", {"head_dim": 32}, True, "bfloat16"),
        # LayerNorm with the residual add and gelu_new in C; the position embedding a torch op (replayed)
        ("gpt2", {}, True, "bfloat16"),
        # float32 linears on the quantized kernel's float32 tiles (AVX-512), SiLU-and-mul in the gated GEMM
        ("llama", {}, True, "float32"),
    ],
)
def test_replay_matches_eager_step_by_step(
    arch: str, overrides: dict[str, Any], captured: bool, dtype: str, tiny_model_factory: Any
) -> None:
    if dtype == "float32" and not quant_gemm.native_f32():
        pytest.skip("float32 linears are oneDNN torch ops here: too many for a graph")
    runner, graphs = make_runner(tiny_model_factory(arch, **overrides), 8, 128, 8 * 8, dtype)
    rng = random.Random(0)
    seqs = [
        SeqState(
            i,
            [rng.randrange(500) for _ in range(5 + 7 * i)],
            0,
            list(range(8 * i, 8 * i + 8)),
            0,
            SamplingOptions(temperature=0.0),
        )
        for i in range(6)
    ]
    with torch.inference_mode():
        out = runner.execute_model(
            runner.prepare_model_input(StepBatch(0, seqs, [len(s.token_ids) for s in seqs], [0] * len(seqs))),
            None,
        )
        for s, t in zip(seqs, out.token_ids):
            s.num_computed_tokens = len(s.token_ids)
            s.token_ids.append(t)
        for step in range(12):
            batch = seqs if step < 6 else seqs[1:4]  # fewer sequences mid-way: more padding rows
            inputs = decode_inputs(runner, batch, step)
            got = graphs.run(inputs).clone()  # captured on the first step of a size, replayed after
            enabled, graphs.enabled = graphs.enabled, False
            want = graphs.run(inputs).clone()  # the eager forward on the same buffers
            graphs.enabled = enabled
            assert torch.equal(got, want), f"step {step}"
            with forward_context(runner._decode_meta):  # the batch as it is, no padding rows: same bits
                unpadded = runner.model(inputs.input_ids, inputs.positions, None)
            assert torch.equal(got, unpadded), f"step {step}"
            tokens = runner.model.compute_logits(want).argmax(-1).tolist()
            for s, t in zip(batch, tokens):
                s.num_computed_tokens += 1
                s.token_ids.append(t)
    kernels = {
        "bfloat16": cpu_amx.available() or quant_gemm.native_bf16(),
        "float32": quant_gemm.native_f32(),
    }
    if captured and kernels[dtype]:  # every linear a C kernel here (AMX, or the AVX-512 tiles)
        # 6 and then 3 sequences run padded to sizes 8 and 4: two graphs
        assert graphs.enabled and graphs.num_captures == 2 and set(graphs.kernel_graphs) == {8, 4}
    for graph in graphs.kernel_graphs.values():  # runs of kernel calls replayed from C: fewer steps
        assert (graph.num_steps < graph.num_kernel_calls) == (load_call_list_library() is not None)
    if not captured:
        assert not graphs.enabled and not graphs.kernel_graphs
    # once a capture has failed, the ModelRunner runs decode unpadded, outside the static buffers
    assert graphs.uses_static_buffers(decode_inputs(runner, seqs, 12)) == graphs.enabled


def test_ops_that_freeze_step_data_abort_the_capture() -> None:
    x = torch.arange(4.0)
    with pytest.raises(GraphUnsupported):
        KernelGraph.capture(lambda: x.sum().item())  # data read into Python
    with pytest.raises(GraphUnsupported):
        KernelGraph.capture(lambda: torch.rand(3))  # a random draw


def test_torch_ops_are_recomputed_views_are_not() -> None:
    x = torch.arange(6.0)
    graph = KernelGraph.capture(lambda: (x.view(2, 3) * 2).to(torch.float64))
    assert graph.num_torch_ops == 2  # mul, and the conversion (flagged a view, yet a copy)
    x.add_(1)
    assert torch.equal(graph.replay(), ((torch.arange(6.0) + 1).view(2, 3) * 2).double())


def test_a_graph_counts_the_memory_it_keeps_alive() -> None:
    x = torch.zeros(64, 32)
    graph = KernelGraph.capture(lambda: (x + 1)[:, :16] * 2)
    # x (kept as a recorded op's argument), x + 1 and its view (one storage), the product
    assert graph.nbytes == 2 * 64 * 32 * 4 + 64 * 16 * 4
    # an opaque oneDNN tensor has no storage to ask: its elements count
    graph = KernelGraph.capture(lambda: (x + 3).to_mkldnn())
    assert graph.nbytes >= 2 * 64 * 32 * 4


def test_graphs_are_kept_while_their_memory_fits(tiny_model_factory: Any) -> None:
    assert kernel_graph_sizes(40) == [1, 2, 4, 8, 16, 32, 40] and kernel_graph_sizes(8) == [1, 2, 4, 8]
    assert kernel_graph_sizes(40, 8) == [1, 2, 4, 8, 16, 24, 32, 40]
    runner, graphs = make_runner(tiny_model_factory("llama"), 40, 64, 64)
    step = 16 if cpu_amx.available() else 8  # AMX: whole 16-row tiles; else rows cost time
    assert graphs.capture_sizes == kernel_graph_sizes(40, step)
    seqs = [SeqState(i, [3 + i, 4, 5], 3, [i], 0, SamplingOptions(temperature=0.0)) for i in range(40)]
    with torch.inference_mode():
        out = graphs.run(decode_inputs(runner, seqs[:40], 0))
        one = graphs.kernel_graphs[40].nbytes
        assert one > 0 and graphs.graph_bytes == one
        graphs.max_graph_bytes = one * 3 // 2  # room for the 40-row graph and a small one, not two large
        for n in (1, 17, 33, 20):  # sizes 1, 32 | 24, 40, 32 | 24 again
            out = graphs.run(decode_inputs(runner, seqs[:n], 0))
            assert out.shape[0] == n  # padding rows sliced off
            assert graphs.graph_bytes <= graphs.max_graph_bytes
    if cpu_amx.available():  # a graph's memory grows with its rows: 1 + 32 fit, 40 + 32 do not
        # 1: [40, 1]; 17: [1, 32] (40 out); 33: [40] (recaptured, 1 and 32 out); 20: [32]
        assert list(graphs.kernel_graphs) == [32] and graphs.num_captures == 5
    graphs.max_graph_bytes = 0  # the newest graph stays whatever the budget
    with torch.inference_mode():
        graphs.run(decode_inputs(runner, seqs[:2], 0))
    assert list(graphs.kernel_graphs) == [2]


def test_capture_does_not_import_dynamo() -> None:
    """torch wraps a dispatch mode's __torch_dispatch__ in a dynamo-disable that imports torch._dynamo at
    the first op (1.1-1.4 s on a 2-core CPU, once per worker, in the first decode step); the recorder
    opts out. A fresh interpreter, since another test may have imported dynamo already."""
    code = (
        "import sys, torch\n"
        "from asyncengine.cpu.kernel_graph import KernelGraph\n"
        "x = torch.arange(6.0)\n"
        "KernelGraph.capture(lambda: x.view(2, 3) * 2)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_a_function_first_looked_up_during_capture_is_captured_again() -> None:
    """ctypes makes a function object on its first lookup; one made inside a capture was never swapped for
    a recorder, so its calls would be missing from the replay. The capture notices and runs again."""
    lib = quant_gemm.load_library()
    assert lib is not None
    saved = vars(lib).pop("qgemm_native_int8")  # as if no one had called it in this process yet
    calls: list[int] = []

    def forward() -> None:
        calls.append(lib.qgemm_native_int8())

    try:
        graph = KernelGraph.capture(forward)
        assert len(calls) == 2 and graph.num_kernel_calls == 1
        graph.replay()  # the recorded call, with its result checked
        assert len(calls) == 2
    finally:
        lib.qgemm_native_int8 = saved  # its restype / argtypes, for the tests after this one


@pytest.mark.skipif(load_call_list_library() is None, reason="call lists need x86-64 / AArch64 Linux")
def test_a_call_list_passes_every_argument_and_checks_results() -> None:
    """Kernels with integer, pointer and float arguments (rms_norm's eps, the 10th) in one C call list give
    what their ctypes calls give; a result other than the captured one stops the list and is named."""
    lib = load_ops_library()
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(64, generator=gen)
    outs = [torch.empty(3, 64) for _ in range(3)]
    eps = (1e-6, 0.5, 30.0)  # a large eps changes the result: a float passed wrong would show

    def forward() -> None:
        for o, e in zip(outs, eps):
            lib.rms_norm_f32(x.data_ptr(), 64, 1, None, w.data_ptr(), o.data_ptr(), None, 3, 64, e, 1)

    graph = KernelGraph.capture(forward)
    assert graph.num_kernel_calls == 3 and graph.num_steps == 1
    want = [o.clone() for o in outs]
    assert not torch.equal(want[0], want[2])
    for o in outs:
        o.zero_()
    graph.replay()
    assert all(torch.equal(o, v) for o, v in zip(outs, want))

    probe = quant_gemm.load_library().qgemm_native_int8  # returns 0 or 1
    graph = KernelGraph()
    graph._record_kernel(probe, (), probe())
    graph._record_kernel(probe, (), 1 - probe())  # as if the capture had seen the other value
    graph._gather_call_lists()
    assert graph.num_steps == 1
    with pytest.raises(RuntimeError, match=f"qgemm_native_int8 returned {probe()} on replay"):
        graph.replay()
