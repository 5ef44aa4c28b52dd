"""Prompt attention in float32 with AVX-512 FMAs (csrc/f32_attention.c).

The float32 counterpart of cpu/bf16_attention.py, with its arguments: all of a step's prompt chunks in one
call, keys read in place through the block tables, causal and sliding windows, GQA. torch's SDPA in
float32 ran at a third to half of the FMA units' peak on long prompts, one call per prompt, and a chunk
after cached context went through a gathered copy of its keys and an explicit mask (bench/prompt_attention.py
prints the comparison). head_dim a multiple of 16 up to 256; other shapes stay with SDPA. The sums run in
another order than SDPA's, so outputs differ from it by float32 rounding (as the decode kernel's already do).

Built with -march=native (cpu/build.py): where the CPU lacks AVX-512 the library's stub reports it
unavailable. ASYNCENGINE_CPU_F32_ATTENTION=0 keeps it off (the A/B against SDPA), read on every call so
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

SOURCE = Path(__file__).parent / "csrc" / "f32_attention.c"
MAX_HEAD_DIM = 256
ENV = "ASYNCENGINE_CPU_F32_ATTENTION"


def allowed() -> bool:
    return os.environ.get(ENV, "1") != "0"


@cache
def load_library() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot run: no compiler, or no AVX-512."""
    lib = build_library(SOURCE)
    if lib is None:
        return None
    lib.f32_attention_available.restype = ctypes.c_int
    lib.f32_attention_available.argtypes = []
    lib.f32_attention_f32.restype = ctypes.c_int
    lib.f32_attention_f32.argtypes = PROMPT_KERNEL_ARGTYPES
    return lib if lib.f32_attention_available() else None


def available() -> bool:
    return allowed() and load_library() is not None


def f32_prompt_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32, rows contiguous
    k: torch.Tensor,  # [num_keys, num_kv_heads, head_dim] float32 (row stride free), or a paged cache
    v: torch.Tensor,
    out: torch.Tensor,  # like q; the rows of `seqs` are written
    seqs: list[tuple[int, int, int, int]],  # (first query row, query rows, first key row, key rows)
    scale: float,
    sliding_window: int | None,
    tables: torch.Tensor | None = None,  # [num_seqs, max_blocks] int32: k / v are [num_blocks, block, Hkv, D]
) -> bool:
    """Causal attention of prompt chunks, all of `seqs` in one call; False where the kernel does not apply
    (no AVX-512, switched off, another dtype, head_dim not a multiple of 16 or over 256), and nothing is
    written.

    With `tables`, each sequence's keys are read in place from the paged cache k / v through its block
    table, and a sequence's third field is the row of `tables` that holds that table."""
    head_dim = q.shape[-1]
    if (
        q.dtype != torch.float32
        or k.dtype != torch.float32
        or v.dtype != torch.float32
        or head_dim % 16
        or head_dim > MAX_HEAD_DIM
        or q.device.type != "cpu"
        or not allowed()
    ):
        return False
    lib = load_library()
    if lib is None:
        return False
    run_prompt_kernel(lib.f32_attention_f32, "float32", q, k, v, out, seqs, scale, sliding_window, tables)
    return True
