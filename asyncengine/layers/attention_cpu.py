"""The CPU attention backend: a small C kernel that reads K/V in place from the paged cache.

The PyTorch reference has to gather every sequence's blocks into a padded tensor per layer, which
dominates a CPU decode step (measured: ~80% of it at batch 64). The kernel in csrc/paged_attention.c
walks the block table instead, with an online softmax, one OpenMP task per group of query rows (rows
that share their leading cache blocks: a speculative step's draft rows, prefix-cache sharers) and run
of KV heads. Prompts and prompt chunks of 16+ rows are dense work: in bfloat16 on a CPU with AMX they go
to csrc/amx_attention.c (all of a step's chunks in one call, keys read in place through the block
tables, both products on AMX tiles; 2.3-2.7x torch's SDPA on the bench's 16-256-token prompts),
otherwise to torch's SDPA, one call per prompt.

The kernel is compiled on first use with the system C compiler (about 0.2 s) into a per-machine
cache; without a compiler, or for dtypes it does not cover, the reference backend is used.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

from asyncengine.layers import cpu_amx
from asyncengine.layers.attention import AttentionMetadata
from asyncengine.layers.attention_torch import TorchAttentionBackend, causal_attention, gather_kv
from asyncengine.layers.csrc_build import build_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
AMX_SOURCE = Path(__file__).parent / "csrc" / "amx_attention.c"
# (query dtype, cache dtype) -> kernel; an e5m2 cache (kv_cache_dtype=fp8_e5m2) is widened in registers
_KERNELS = {
    (torch.float32, torch.float32): "paged_attention_f32",
    (torch.bfloat16, torch.bfloat16): "paged_attention_bf16",
    (torch.float32, torch.float8_e5m2): "paged_attention_f32_e5m2",
    (torch.bfloat16, torch.float8_e5m2): "paged_attention_bf16_e5m2",
}
SDPA_MIN_ROWS = 16  # a prompt chunk at least this long after cached context goes to SDPA (see forward)
# limits compiled into the kernel (MAX_HEAD_DIM, MAX_BLOCK, MAX_GROUP); beyond them: the reference


@cache
def load_kernel_library(portable: bool = False) -> ctypes.CDLL | None:
    """Builds (once per source, flags and CPU) and loads the kernel; None when it cannot be built.
    `portable` builds the plain-C variant even where AVX-512 is available (tests cover both)."""
    lib = build_library(SOURCE, portable)
    if lib is None:
        return None
    for name in _KERNELS.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return lib


@cache
def load_amx_library() -> ctypes.CDLL | None:
    """The AMX prompt-attention kernel (csrc/amx_attention.c), or None where it cannot run: no compiler,
    no AMX-BF16, tile state not granted, or ASYNCENGINE_CPU_AMX=0."""
    if not cpu_amx.allowed():
        return None
    lib = build_library(AMX_SOURCE)
    if lib is None:
        return None
    lib.amx_attention_available.restype = ctypes.c_int
    lib.amx_attention_available.argtypes = []
    lib.amx_attention_bf16.restype = ctypes.c_int
    lib.amx_attention_bf16.argtypes = ([ctypes.c_void_p, ctypes.c_long] * 4 + [ctypes.c_void_p, ctypes.c_int]
                                       + [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
    return lib if lib.amx_attention_available() else None


def amx_prompt_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] bfloat16, rows contiguous
    k: torch.Tensor,  # [num_keys, num_kv_heads, head_dim] bfloat16 (row stride free), or a paged cache
    v: torch.Tensor,
    out: torch.Tensor,  # like q; the rows of `seqs` are written
    seqs: list[tuple[int, int, int, int]],  # (first query row, query rows, first key row, key rows)
    scale: float,
    sliding_window: int | None,
    tables: torch.Tensor | None = None,  # [num_seqs, max_blocks] int32: k / v are [num_blocks, block, Hkv, D]
) -> bool:
    """Causal attention of prompt chunks on AMX, all of `seqs` in one call; False where the kernel does not
    apply (no AMX, another dtype, head_dim not a multiple of 32 or over 256), and nothing is written.

    With `tables`, each sequence's keys are read in place from the paged cache k / v through its block
    table, and a sequence's third field is the row of `tables` that holds that table."""
    head_dim = q.shape[-1]
    # the shape and dtype first: a float32 worker never builds the library nor asks for AMX tile state
    if (q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16
            or head_dim % 32 or head_dim > 256 or q.device.type != "cpu"):
        return False
    lib = load_amx_library()
    if lib is None:
        return False
    block_size = 0
    if tables is not None:
        assert k.is_contiguous() and v.is_contiguous() and tables.is_contiguous() and tables.dtype == torch.int32
        block_size = k.shape[1]
        k, v = k.flatten(0, 1), v.flatten(0, 1)  # [num_blocks * block, Hkv, D]
    k, v = (t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous() for t in (k, v))
    assert q.is_contiguous() and out.is_contiguous()
    info = torch.tensor(seqs, dtype=torch.int32)
    rc = lib.amx_attention_bf16(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                out.data_ptr(), out.stride(0), info.data_ptr(), len(seqs),
                                tables.data_ptr() if tables is not None else None,
                                tables.stride(0) if tables is not None else 0, block_size, q.shape[1], k.shape[1],
                                head_dim, scale, sliding_window or 0, torch.get_num_threads())
    if rc == -2:
        raise MemoryError("AMX attention kernel could not allocate its scratch buffers")
    if rc != 0:
        raise ValueError(f"AMX attention kernel rejected the call (heads {q.shape[1]}/{k.shape[1]}, head_dim "
                         f"{head_dim}, or a chunk with more query rows than keys)")
    return True


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
        dense = [ql > 1 and (ql == sl or ql >= SDPA_MIN_ROWS) for ql, sl in zip(meta.query_lens_cpu, meta.seq_lens_cpu)]
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
        kernel = _KERNELS.get((q.dtype, k_cache.dtype))
        supported = q.shape[2] <= 512 and k_cache.shape[1] <= 256 and q.shape[1] // max(k.shape[1], 1) <= 64
        if self.lib is None or kernel is None or not supported or not k_cache.numel() or q.device.type != "cpu":
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
    def _prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, meta: AttentionMetadata, step: _StepArgs, scale: float,
                 sliding_window: int | None) -> None:
        """The dense rows. With a bfloat16 cache on AMX: every prompt chunk in one call that reads its keys in
        place through the block tables (this step's were written before attention), fresh prompts and
        chunks after cached context alike. Otherwise fresh prompts attend over this step's keys and
        chunks after cached context over their gathered blocks, one SDPA call each."""
        start, dense = 0, []
        for i, (q_len, seq_len, is_dense) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, step.dense)):
            if is_dense:
                dense.append((i, start, q_len, seq_len))
            start += q_len
        if amx_prompt_attention(q, k_cache, v_cache, out, [(s, n, i, seq_len) for i, s, n, seq_len in dense], scale,
                                sliding_window, step.tables):
            return
        fresh = [(s, n, s, n) for _, s, n, seq_len in dense if n == seq_len]  # over this step's keys directly
        if fresh and not amx_prompt_attention(q, k, v, out, fresh, scale, sliding_window):
            for s, n, _, _ in fresh:
                out[s:s + n] = causal_attention(q[s:s + n], k[s:s + n], v[s:s + n], scale, sliding_window)
        for i, s, n, seq_len in dense:
            if n == seq_len:
                continue
            keys = gather_kv(k_cache, meta.block_tables[i], seq_len, q.dtype)
            values = gather_kv(v_cache, meta.block_tables[i], seq_len, q.dtype)
            if not amx_prompt_attention(q, keys, values, out, [(s, n, 0, seq_len)], scale, sliding_window):
                out[s:s + n] = causal_attention(q[s:s + n], keys, values, scale, sliding_window)

    def _run_kernel(self, kernel: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, step: _StepArgs, scale: float, window: int) -> None:
        tables, query_start, seq_lens, skip = step.tables, step.query_start, step.seq_lens, step.skip
        num_seqs = seq_lens.shape[0]
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        rc = getattr(self.lib, kernel)(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr(),
            query_start.data_ptr(), seq_lens.data_ptr(), skip.data_ptr() if skip is not None else None,
            num_seqs, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], tables.shape[1],
            scale, window, torch.get_num_threads(),
        )
        if rc == -2:
            raise MemoryError("CPU attention kernel could not allocate its scratch buffer")
        if rc != 0:
            raise ValueError(f"CPU attention kernel does not support head_dim={q.shape[2]}, "
                             f"block_size={k_cache.shape[1]}, heads {q.shape[1]}/{k_cache.shape[2]}")
