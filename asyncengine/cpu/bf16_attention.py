"""Prompt attention in bfloat16 with AVX512-BF16 (csrc/bf16_attention.c), for CPUs without AMX.

The counterpart of cpu/attention.py's amx_prompt_attention, with its arguments: all of a step's prompt
chunks in one call, keys read in place through the block tables, causal and sliding windows, GQA. torch's
SDPA in bfloat16 reached only 13-55 GFLOP/s on a 2-core AVX512-BF16 EPYC (bench/prompt_attention.py
prints the comparison). head_dim a multiple of 32 up to 256 (64 and 128 with their loops unrolled);
other shapes stay with SDPA.

Built with -march=native (cpu/build.py): where the CPU lacks AVX512-BF16 the library's stub reports it
unavailable. ASYNCENGINE_CPU_BF16_ATTENTION=0 keeps it off (the A/B against SDPA), read on every call so
that a bench can switch it within one process.
"""

from __future__ import annotations

import torch

from asyncengine.cpu.attention import PromptKernel

MAX_HEAD_DIM = 256  # csrc/bf16_attention.c: the query tile's scratch on the stack
ENV = "ASYNCENGINE_CPU_BF16_ATTENTION"


def takes_head_dim(head_dim: int) -> bool:
    """Whole 16 x 16 word transposes of the query rows: 32 dims at a time."""
    return head_dim % 32 == 0 and 0 < head_dim <= MAX_HEAD_DIM


bf16_prompt_attention = PromptKernel("bf16_attention", torch.bfloat16, ENV, takes_head_dim, "bf16")
load_library = bf16_prompt_attention.load_library
