"""The CPU attention kernels: loading them and calling them through ctypes.

* csrc/paged_attention.c reads K/V in place from the paged cache, walking the block tables with an online
  softmax, one OpenMP task per group of query rows (rows that share their leading cache blocks: a
  speculative step's draft rows, prefix-cache sharers) and run of KV heads;
* csrc/amx_attention.c: causal attention of prompt chunks in bfloat16 on AMX tiles, all of a step's chunks
  in one call, keys read in place through the block tables (2.3-2.7x torch's SDPA on the bench's
  16-256-token prompts).

Both are compiled on first use with the system C compiler (about 0.2 s) into a per-machine cache (build.py).
The backend that routes a step's rows to them (and to torch where they do not apply) is
asyncengine.layers.attention_cpu.CpuAttentionBackend.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

from asyncengine.cpu import amx
from asyncengine.cpu.build import build_library

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
AMX_SOURCE = Path(__file__).parent / "csrc" / "amx_attention.c"
# (query dtype, cache dtype) -> kernel; an e5m2 cache (kv_cache_dtype=fp8_e5m2) is widened in registers
_KERNELS = {
    (torch.float32, torch.float32): "paged_attention_f32",
    (torch.bfloat16, torch.bfloat16): "paged_attention_bf16",
    (torch.float32, torch.float8_e5m2): "paged_attention_f32_e5m2",
    (torch.bfloat16, torch.float8_e5m2): "paged_attention_bf16_e5m2",
}
# limits compiled into the kernel (MAX_HEAD_DIM, MAX_BLOCK, MAX_GROUP); beyond them callers use torch
MAX_HEAD_DIM, MAX_BLOCK, MAX_GROUP = 512, 256, 64


# the signature both C prompt kernels share (see run_prompt_kernel): q, k, v, out with their row strides;
# the sequences and their count; block tables, their stride; block size, heads, kv heads, head_dim;
# scale, window, threads
PROMPT_KERNEL_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_long] * 4
    + [ctypes.c_void_p, ctypes.c_int]
    + [ctypes.c_void_p]
    + [ctypes.c_int] * 5
    + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
)


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
        fn.argtypes = (
            [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        )
    lib.paged_attention_use_amx.restype = ctypes.c_int
    lib.paged_attention_use_amx.argtypes = [ctypes.c_int]
    # grouped-query decode scores on AMX tiles where the build has them (ASYNCENGINE_CPU_AMX=0: off, as every
    # AMX kernel); the kernel asks Linux for the tile state on its first such call
    lib.paged_attention_use_amx(int(amx.allowed()))
    return lib


def paged_kernel(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int) -> str | None:
    """The paged-attention kernel's name for q [T, heads, head_dim] over k_cache [blocks, block_size,
    kv_heads, head_dim], or None where it does not apply (dtypes, limits, an empty cache, not CPU)."""
    kernel = _KERNELS.get((q.dtype, k_cache.dtype))
    if kernel is None or q.device.type != "cpu" or not k_cache.numel() or q.dim() != 3 or k_cache.dim() != 4:
        return None
    supported = (
        q.shape[2] <= MAX_HEAD_DIM
        and k_cache.shape[1] <= MAX_BLOCK
        and q.shape[1] // max(num_kv_heads, 1) <= MAX_GROUP
    )
    return kernel if supported else None


def paged_attention(
    lib: ctypes.CDLL,  # from load_kernel_library
    kernel: str,  # from paged_kernel
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    out: torch.Tensor,  # like q; every row not skipped is written
    tables: torch.Tensor,  # [num_seqs, max_blocks] int32, contiguous
    query_start: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    skip: torch.Tensor | None,  # [num_seqs] uint8: sequences whose rows are left alone; None: none
    scale: float,
    window: int,  # sliding window, 0 for none
) -> None:
    """Attention of every query row over its sequence's keys in the paged cache (causal by position)."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    rc = getattr(lib, kernel)(  # looked up per call: kernel-graph capture swaps the library's functions
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        tables.data_ptr(),
        query_start.data_ptr(),
        seq_lens.data_ptr(),
        skip.data_ptr() if skip is not None else None,
        seq_lens.shape[0],
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        tables.shape[1],
        scale,
        window,
        torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError("CPU attention kernel could not allocate its scratch buffer")
    if rc != 0:
        raise ValueError(
            f"CPU attention kernel does not support head_dim={q.shape[2]}, "
            f"block_size={k_cache.shape[1]}, heads {q.shape[1]}/{k_cache.shape[2]}"
        )


@cache
def load_amx_library() -> ctypes.CDLL | None:
    """The AMX prompt-attention kernel (csrc/amx_attention.c), or None where it cannot run: no compiler,
    no AMX-BF16, tile state not granted, or ASYNCENGINE_CPU_AMX=0."""
    if not amx.allowed():
        return None
    lib = build_library(AMX_SOURCE)
    if lib is None:
        return None
    lib.amx_attention_available.restype = ctypes.c_int
    lib.amx_attention_available.argtypes = []
    lib.amx_attention_bf16.restype = ctypes.c_int
    lib.amx_attention_bf16.argtypes = PROMPT_KERNEL_ARGTYPES
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
    apply (no AMX, another dtype, head_dim not a multiple of 32 or over 256, a scale not above 0), and
    nothing is written.

    With `tables`, each sequence's keys are read in place from the paged cache k / v through its block
    table, and a sequence's third field is the row of `tables` that holds that table."""
    head_dim = q.shape[-1]
    # the shape and dtype first: a float32 worker never builds the library nor asks for AMX tile state
    if (
        q.dtype != torch.bfloat16
        or k.dtype != torch.bfloat16
        or v.dtype != torch.bfloat16
        or head_dim % 32
        or head_dim > 256
        or q.device.type != "cpu"
        or not scale > 0  # the kernel takes each row's maximum before scaling (models' scales are > 0)
    ):
        return False
    lib = load_amx_library()
    if lib is None:
        return False
    run_prompt_kernel(lib.amx_attention_bf16, "AMX", q, k, v, out, seqs, scale, sliding_window, tables)
    return True


def run_prompt_kernel(
    fn: Any,
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    seqs: list[tuple[int, int, int, int]],
    scale: float,
    sliding_window: int | None,
    tables: torch.Tensor | None,
) -> None:
    """Calls a C prompt-attention kernel of the shared signature (amx_attention.c, bf16_attention.c) on
    tensors its caller has checked it takes; raises on a call the kernel refuses."""
    head_dim = q.shape[-1]
    block_size = 0
    if tables is not None:
        assert (
            k.is_contiguous() and v.is_contiguous() and tables.is_contiguous() and tables.dtype == torch.int32
        )
        block_size = k.shape[1]
        k, v = k.flatten(0, 1), v.flatten(0, 1)  # [num_blocks * block, Hkv, D]
    k, v = (t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous() for t in (k, v))
    assert q.is_contiguous() and out.is_contiguous()
    info = torch.tensor(seqs, dtype=torch.int32)
    rc = fn(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        out.data_ptr(),
        out.stride(0),
        info.data_ptr(),
        len(seqs),
        tables.data_ptr() if tables is not None else None,
        tables.stride(0) if tables is not None else 0,
        block_size,
        q.shape[1],
        k.shape[1],
        head_dim,
        scale,
        sliding_window or 0,
        torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError(f"{name} attention kernel could not allocate its scratch buffers")
    if rc != 0:
        raise ValueError(
            f"{name} attention kernel rejected the call (heads {q.shape[1]}/{k.shape[1]}, head_dim "
            f"{head_dim}, or a chunk with more query rows than keys)"
        )


class PromptKernel:
    """A C prompt-attention kernel of run_prompt_kernel's signature in a library of its own
    (csrc/bf16_attention.c, csrc/f32_attention.c), for one dtype: built with -march=native on first use,
    where the library's `<name>_available()` says the CPU can run it; `env`=0 keeps it off, read on every
    call so that a bench can switch it within one process."""

    def __init__(
        self, name: str, dtype: torch.dtype, env: str, takes_head_dim: Callable[[int], bool], label: str
    ) -> None:
        self.name, self.dtype, self.env, self.label = name, dtype, env, label
        self.source = Path(__file__).parent / "csrc" / f"{name}.c"
        self.takes_head_dim = takes_head_dim
        self._lib: ctypes.CDLL | None = None
        self._fn: Any = None  # the kernel's function in _lib
        self._loaded = False

    def allowed(self) -> bool:
        return os.environ.get(self.env, "1") != "0"

    def load_library(self) -> ctypes.CDLL | None:
        """The kernel library, or None where it cannot run: no compiler, or not this CPU's."""
        if not self._loaded:
            lib = build_library(self.source)
            if lib is not None:
                available = getattr(lib, f"{self.name}_available")
                available.restype, available.argtypes = ctypes.c_int, []
                if available():
                    self._lib, self._fn = lib, getattr(lib, f"{self.name}_{self.label}")
                    self._fn.restype, self._fn.argtypes = ctypes.c_int, PROMPT_KERNEL_ARGTYPES
            self._loaded = True
        return self._lib

    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows contiguous
        k: torch.Tensor,  # [num_keys, num_kv_heads, head_dim] (row stride free), or a paged cache
        v: torch.Tensor,
        out: torch.Tensor,  # like q; the rows of `seqs` are written
        seqs: list[tuple[int, int, int, int]],  # (first query row, query rows, first key row, key rows)
        scale: float,
        sliding_window: int | None,
        tables: torch.Tensor | None = None,  # [num_seqs, max_blocks] int32: k, v [num_blocks, block, Hkv, D]
    ) -> bool:
        """Causal attention of prompt chunks, all of `seqs` in one call; False where the kernel does not
        apply (the CPU lacks it, switched off, another dtype or head_dim), and nothing is written.

        With `tables`, each sequence's keys are read in place from the paged cache k / v through its block
        table, and a sequence's third field is the row of `tables` that holds that table."""
        # the shape and dtype first: a worker of another dtype never builds the library
        if (
            q.dtype != self.dtype
            or k.dtype != self.dtype
            or v.dtype != self.dtype
            or not self.takes_head_dim(q.shape[-1])
            or q.device.type != "cpu"
            or not self.allowed()
        ):
            return False
        if self.load_library() is None:
            return False
        run_prompt_kernel(self._fn, self.label, q, k, v, out, seqs, scale, sliding_window, tables)
        return True
