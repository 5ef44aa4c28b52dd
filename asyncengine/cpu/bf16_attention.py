"""Prompt attention in bfloat16 with AVX512-BF16 (csrc/bf16_attention.c), for CPUs without AMX.

The counterpart of cpu/attention.py's amx_prompt_attention, with its arguments: all of a step's prompt
chunks in one call, keys read in place through the block tables, causal and sliding windows, GQA. torch's
SDPA in bfloat16 reached only 13-55 GFLOP/s on a 2-core AVX512-BF16 EPYC (bench/prompt_attention.py
prints the comparison). head_dim 64 and 128; other shapes stay with SDPA.

Built with -march=native (cpu/build.py): where the CPU lacks AVX512-BF16 the library's stub reports it
unavailable. ASYNCENGINE_CPU_BF16_ATTENTION=0 keeps it off (the A/B against SDPA), read on every call so
that a bench can switch it within one process.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import torch

from asyncengine.cpu.attention import PROMPT_KERNEL_ARGTYPES, run_prompt_kernel
from asyncengine.cpu.build import build_library

SOURCE = Path(__file__).parent / "csrc" / "bf16_attention.c"
HEAD_DIMS = (64, 128)  # compiled into the kernel's register blocking
ENV = "ASYNCENGINE_CPU_BF16_ATTENTION"


def allowed() -> bool:
    return os.environ.get(ENV, "1") != "0"


@cache
def load_library() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot run: no compiler, or no AVX512-BF16."""
    lib = build_library(SOURCE)
    if lib is None:
        return None
    lib.bf16_attention_available.restype = ctypes.c_int
    lib.bf16_attention_available.argtypes = []
    lib.bf16_attention_bf16.restype = ctypes.c_int
    lib.bf16_attention_bf16.argtypes = PROMPT_KERNEL_ARGTYPES
    return lib if lib.bf16_attention_available() else None


def available() -> bool:
    return allowed() and load_library() is not None


def bf16_prompt_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] bfloat16, rows contiguous
    k: torch.Tensor,  # [num_keys, num_kv_heads, head_dim] bfloat16 (row stride free), or a paged cache
    v: torch.Tensor,
    out: torch.Tensor,  # like q; the rows of `seqs` are written
    seqs: list[tuple[int, int, int, int]],  # (first query row, query rows, first key row, key rows)
    scale: float,
    sliding_window: int | None,
    tables: torch.Tensor | None = None,  # [num_seqs, max_blocks] int32: k / v are [num_blocks, block, Hkv, D]
) -> bool:
    """Causal attention of prompt chunks, all of `seqs` in one call; False where the kernel does not apply
    (no AVX512-BF16, switched off, another dtype, head_dim not 64 or 128), and nothing is written.

    With `tables`, each sequence's keys are read in place from the paged cache k / v through its block
    table, and a sequence's third field is the row of `tables` that holds that table."""
    head_dim = q.shape[-1]
    # the shape and dtype first: a float32 worker never builds the library
    if (
        q.dtype != torch.bfloat16
        or k.dtype != torch.bfloat16
        or v.dtype != torch.bfloat16
        or head_dim not in HEAD_DIMS
        or q.device.type != "cpu"
        or not allowed()
    ):
        return False
    lib = load_library()
    if lib is None:
        return False
    run_prompt_kernel(lib.bf16_attention_bf16, "bf16", q, k, v, out, seqs, scale, sliding_window, tables)
    return True
