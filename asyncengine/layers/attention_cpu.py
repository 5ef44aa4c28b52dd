"""The CPU attention backend: routes a step's rows to the C kernels of asyncengine.cpu.attention.

The PyTorch reference has to gather every sequence's blocks into a padded tensor per layer, which
dominates a CPU decode step (measured: ~80% of it at batch 64). The paged kernel (cpu/csrc/paged_attention.c)
walks the block table instead. Prompts and prompt chunks of 16+ rows are dense work: in bfloat16 on a CPU
with AMX they go to cpu/csrc/amx_attention.c (all of a step's chunks in one call), without AMX but with
AVX512-BF16 to cpu/csrc/bf16_attention.c (the same interface, vdpbf16ps products); in float32 on an
AVX-512 CPU to cpu/csrc/f32_attention.c (the same interface, FMAs); otherwise to torch's SDPA, one call
per prompt.

Without a compiler, or for dtypes and shapes the kernel does not cover, the reference backend is used.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from asyncengine.cpu.attention import amx_prompt_attention, load_kernel_library, paged_attention, paged_kernel
from asyncengine.cpu.bf16_attention import bf16_prompt_attention
from asyncengine.cpu.f32_attention import f32_prompt_attention
from asyncengine.layers.attention_backend import AttentionMetadata
from asyncengine.layers.attention_torch import TorchAttentionBackend, causal_attention, gather_kv

SDPA_MIN_ROWS = 16  # a prompt chunk at least this long after cached context goes to SDPA (see forward)


def _prompt_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    seqs: list[tuple[int, int, int, int]],
    scale: float,
    sliding_window: int | None,
    tables: torch.Tensor | None = None,
) -> bool:
    """The prompt chunks `seqs` by a C kernel: in bfloat16 AMX first, then AVX512-BF16, in float32 the
    AVX-512 one (each declines, writing nothing, where it does not apply: the AVX512-BF16 one only takes
    head_dim multiples of 32 up to 256); False: SDPA's turn."""
    args = (q, k, v, out, seqs, scale, sliding_window, tables)
    return amx_prompt_attention(*args) or bf16_prompt_attention(*args) or f32_prompt_attention(*args)


class _StepArgs(NamedTuple):
    tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    dense: list[bool]  # per sequence: attended by SDPA (a prompt chunk), not by the kernel
    skip: torch.Tensor | None  # dense as the kernel's uint8 mask; None when no sequence is dense


class CpuAttentionBackend:
    """Paged attention for CPU workers: the C kernel over the cache, SDPA for fresh prefills."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self.lib = lib or load_kernel_library()
        self.reference = TorchAttentionBackend()
        self._step: tuple[AttentionMetadata, _StepArgs] | None = None  # every layer of a step shares these

    def _step_args(self, meta: AttentionMetadata) -> _StepArgs:
        """The kernel's int32 views of the step's metadata and its SDPA routing, built once per step."""
        if self._step is not None and self._step[0] is meta:
            return self._step[1]
        n = meta.num_seqs
        # Prompt chunks go to torch's SDPA (blocked GEMMs, flash kernel): a fresh prompt attends over its
        # own keys, a chunk after cached context (prefix hit, chunked prefill) over its gathered blocks.
        # The kernel takes decode rows and short chunks: it walks the cache once per query row, which
        # measured 3-4x slower than a gather + SDPA for a 200-row chunk but 2x faster for 4 rows.
        dense = [
            ql > 1 and (ql == sl or ql >= SDPA_MIN_ROWS)
            for ql, sl in zip(meta.query_lens_cpu, meta.seq_lens_cpu)
        ]
        args = _StepArgs(
            tables=meta.block_tables[:n].to(torch.int32).contiguous(),
            query_start=meta.query_start_loc[: n + 1].to(torch.int32).contiguous(),
            seq_lens=meta.seq_lens[:n].to(torch.int32).contiguous(),
            dense=dense,
            skip=torch.tensor(dense, dtype=torch.uint8) if any(dense) else None,
        )
        self._step = (meta, args)
        return args

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        kernel = paged_kernel(q, k_cache, k.shape[1])
        if self.lib is None or kernel is None:
            return self.reference.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
        q = q.contiguous()
        out = torch.empty_like(q)
        step = self._step_args(meta)
        dense, skip = step.dense, step.skip
        if skip is None or not all(dense):
            self._run_kernel(kernel, q, k_cache, v_cache, out, step, scale, sliding_window or 0)
        if skip is not None:
            self._prompts(q, k, v, k_cache, v_cache, out, meta, step, scale, sliding_window)
        return out

    @staticmethod
    def _prompts(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        meta: AttentionMetadata,
        step: _StepArgs,
        scale: float,
        sliding_window: int | None,
    ) -> None:
        """The dense rows. With a bfloat16 cache on AMX or AVX512-BF16, or a float32 one on AVX-512: every
        prompt chunk in one call that reads its keys in place through the block tables (this step's were
        written before attention), fresh prompts and chunks after cached context alike. Otherwise (a
        float8 cache, a head_dim the kernels do not take) fresh prompts attend over this step's keys and
        chunks after cached context over their gathered blocks, by a kernel where the dtype then fits, else
        one SDPA call each."""
        start, dense = 0, []
        for i, (q_len, seq_len, is_dense) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, step.dense)
        ):
            if is_dense:
                dense.append((i, start, q_len, seq_len))
            start += q_len
        if _prompt_kernel(
            q,
            k_cache,
            v_cache,
            out,
            [(s, n, i, seq_len) for i, s, n, seq_len in dense],
            scale,
            sliding_window,
            step.tables,
        ):
            return
        fresh = [(s, n, s, n) for _, s, n, seq_len in dense if n == seq_len]  # over this step's keys directly
        if fresh and not _prompt_kernel(q, k, v, out, fresh, scale, sliding_window):
            for s, n, _, _ in fresh:
                out[s : s + n] = causal_attention(
                    q[s : s + n], k[s : s + n], v[s : s + n], scale, sliding_window
                )
        for i, s, n, seq_len in dense:
            if n == seq_len:
                continue
            keys = gather_kv(k_cache, meta.block_tables[i], seq_len, q.dtype)
            values = gather_kv(v_cache, meta.block_tables[i], seq_len, q.dtype)
            if not _prompt_kernel(q, keys, values, out, [(s, n, 0, seq_len)], scale, sliding_window):
                out[s : s + n] = causal_attention(q[s : s + n], keys, values, scale, sliding_window)

    def _run_kernel(
        self,
        kernel: str,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        step: _StepArgs,
        scale: float,
        window: int,
    ) -> None:
        paged_attention(
            self.lib,
            kernel,
            q,
            k_cache,
            v_cache,
            out,
            step.tables,
            step.query_start,
            step.seq_lens,
            step.skip,
            scale,
            window,
        )
