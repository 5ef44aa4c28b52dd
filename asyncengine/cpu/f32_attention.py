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

import torch

from asyncengine.cpu.attention import PromptKernel

MAX_HEAD_DIM = 256  # the kernel's stack scratch
ENV = "ASYNCENGINE_CPU_F32_ATTENTION"


def takes_head_dim(head_dim: int) -> bool:
    return head_dim % 16 == 0 and 0 < head_dim <= MAX_HEAD_DIM


f32_prompt_attention = PromptKernel("f32_attention", torch.float32, ENV, takes_head_dim, "f32")
load_library = f32_prompt_attention.load_library
