"""Fused CPU element-wise ops (csrc/cpu_ops.c): RMSNorm and LayerNorm (+ residual add), SiLU-and-mul,
GPT-2's GELU (gelu_new), rotary, the paged KV-cache write, and rotary fused with that write.

Each returns None when it does not apply (not a CPU tensor, a dtype other than float32 / bfloat16,
no compiler, or ASYNCENGINE_CPU_OPS=0) and the caller runs its PyTorch code instead; the results
equal PyTorch's up to float32 summation order (tests/asyncengine/cpu/test_cpu_ops.py). In a
bfloat16 decode step of a 12-layer model they replace ~100 torch ops per layer-set with 4 calls.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from asyncengine.cpu.build import build_library

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.c"
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
# read once: the lookup runs ~70 times a decode step, and a worker's environment does not change
_enabled = os.environ.get("ASYNCENGINE_CPU_OPS", "1") != "0"
_SIGNATURES = {
    "rms_norm": [_P, _L, _I, _P, _P, _P, _P, _I, _I, _F, _I],
    "silu_and_mul": [_P, _P, _I, _I, _I],
    "rotary": [_P, _L, _P, _P, _P, _I, _I, _I, _I, _I],
    "argmax_rows": [_P, _L, _I, _I, _P, _I],
    "gelu_new": [_P, _P, _L, _I],
    "layer_norm": [_P, _L, _P, _P, _P, _P, _P, _I, _I, _F, _I],
}


@cache
def load_ops_library(portable: bool = False) -> ctypes.CDLL | None:
    lib = build_library(SOURCE, portable)
    if lib is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        for suffix in _SUFFIX.values():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.restype = None
            fn.argtypes = argtypes
    lib.gather_rows.restype = _L
    lib.gather_rows.argtypes = [_P, _I, _L, _L, _P, _L, _P, _I]
    lib.write_kv.restype = _L
    lib.write_kv.argtypes = [_P, _L, _P, _L, _P, _P, _P, _L, _I, _I]
    for suffix in _SUFFIX.values():
        fn = getattr(lib, f"rope_write_kv_{suffix}")
        fn.restype = _L
        fn.argtypes = [_P, _L, _P, _L, _P, _L, _P, _P, _P, _P, _P, _P, _P, _L, _I, _I, _I, _I, _I, _I]
    return lib


@contextmanager
def disabled() -> Iterator[None]:
    """Inside the block every op returns None, so callers run their PyTorch code (A/B tests, benches)."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


def _lib_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    if not _enabled:
        return None
    t = tensors[0]
    if t.device.type != "cpu" or t.dtype not in _SUFFIX or any(x.dtype != t.dtype for x in tensors):
        return None
    return load_ops_library()


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, width] with unit stride along width (row stride free), or None."""
    if x.dim() != 2 or x.stride(1) != 1:
        return None
    return x


def _norm_rows(
    name: str,
    x: torch.Tensor,
    params: tuple[torch.Tensor | None, ...],
    eps: float,
    residual: torch.Tensor | None,
    *before_residual: int,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """rms_norm / layer_norm over the rows of x with an optional residual add: the checks, the outputs and
    the call they share. The C functions take (x, x_stride, *before_residual, residual, *params, out,
    residual_out, rows, hidden, eps, num_threads); a None param (LayerNorm without a bias) passes NULL."""
    present = tuple(p for p in params if p is not None)
    lib = _lib_for(x, *present) if residual is None else _lib_for(x, *present, residual)
    x2 = _rows(x)
    if lib is None or x2 is None or any(not p.is_contiguous() for p in present):
        return None
    rows, hidden = x2.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)
    new_residual = None
    if residual is not None:
        residual = residual.contiguous()
        new_residual = torch.empty(rows, hidden, dtype=x.dtype)
    getattr(lib, f"{name}_{_SUFFIX[x.dtype]}")(
        x2.data_ptr(),
        x2.stride(0),
        *before_residual,
        residual.data_ptr() if residual is not None else None,
        *(p.data_ptr() if p is not None else None for p in params),
        out.data_ptr(),
        new_residual.data_ptr() if new_residual is not None else None,
        rows,
        hidden,
        eps,
        torch.get_num_threads(),
    )
    return out, new_residual


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """[T, hidden] -> (norm(x'), x') with x' = x + residual, or (norm(x), None) without a residual."""
    return _norm_rows("rms_norm", x, (weight,), eps, residual, 1)  # 1: one head a row


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor | None:
    """[T, heads * head_dim] -> the same with each head_dim-wide head RMS-normalised on its own (Qwen3's
    q_norm / k_norm), read in place from a strided qkv slice: one call, no copy, no torch op (a decode
    step's kernel graph takes it)."""
    lib = _lib_for(x, weight)
    x2 = _rows(x)
    if lib is None or x2 is None or not weight.is_contiguous() or x2.shape[1] % head_dim:
        return None
    tokens, width = x2.shape
    heads = width // head_dim
    out = torch.empty(tokens, width, dtype=x.dtype)
    getattr(lib, f"rms_norm_{_SUFFIX[x.dtype]}")(
        x2.data_ptr(),
        x2.stride(0),
        heads,
        None,
        weight.data_ptr(),
        out.data_ptr(),
        None,
        tokens * heads,
        head_dim,
        eps,
        torch.get_num_threads(),
    )
    return out


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """[T, hidden] -> (layer_norm(x'), x') with x' = x + residual, or (layer_norm(x), None) without one."""
    return _norm_rows("layer_norm", x, (weight, bias), eps, residual)


def gelu_new(x: torch.Tensor) -> torch.Tensor | None:
    """GPT-2's tanh GELU (HF's NewGELUActivation) in one pass, with torch's rounding chain."""
    lib = _lib_for(x)
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    getattr(lib, f"gelu_new_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), out.data_ptr(), x.numel(), torch.get_num_threads()
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """[T, 2 * inter] = [gate | up] -> silu(gate) * up, [T, inter]."""
    lib = _lib_for(x)
    if lib is None or x.dim() != 2 or x.shape[1] % 2:
        return None
    x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype)
    getattr(lib, f"silu_and_mul_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads()
    )
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor | None:
    """Rotate-half rotary embedding of [T, heads * head_dim] with [T, half] cos / sin tables."""
    lib = _lib_for(x, cos, sin)
    x2 = _rows(x)
    if lib is None or x2 is None or x.shape[1] % head_dim:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    rows, width = x2.shape
    out = torch.empty(rows, width, dtype=x.dtype)
    getattr(lib, f"rotary_{_SUFFIX[x.dtype]}")(
        x2.data_ptr(),
        x2.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
        rows,
        width // head_dim,
        head_dim,
        cos.shape[-1],
        torch.get_num_threads(),
    )
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """[N, V] -> [N] int64: each row's first maximal index (a NaN's where the row has one), as
    x.max(dim=-1).indices; reads bfloat16 logits as they are."""
    lib = _lib_for(x)
    x2 = _rows(x)
    if lib is None or x2 is None or not 0 < x.shape[1] < 2**31:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    getattr(lib, f"argmax_rows_{_SUFFIX[x.dtype]}")(
        x2.data_ptr(), x2.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """k, v [T, kv_heads, head_dim] -> their slots of [num_blocks, block_size, kv_heads, head_dim] caches.
    False (nothing written) where it does not apply; IndexError for a slot outside the cache."""
    # a byte copy: any dtype works, float8 caches (kv_cache_dtype=fp8_e5m2) included
    if not _enabled or any(x.device.type != "cpu" or x.dtype != k.dtype for x in (v, k_cache, v_cache)):
        return False
    lib = load_ops_library()
    if (
        lib is None
        or slot_mapping.dtype != torch.int64
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return False
    heads, head_dim = k.shape[1], k.shape[2]
    if any(x.stride(2) != 1 or x.stride(1) != head_dim for x in (k, v)) or k_cache.shape[-2:] != (
        heads,
        head_dim,
    ):
        return False
    slots = slot_mapping.contiguous()
    elem = k.element_size()
    bad = lib.write_kv(
        k.data_ptr(),
        k.stride(0) * elem,
        v.data_ptr(),
        v.stride(0) * elem,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        k_cache.numel() // (heads * head_dim),
        k.shape[0],
        heads * head_dim * elem,
    )
    if bad:
        raise IndexError(f"{bad} KV-cache slot(s) outside the cache of {k_cache.shape[0]} blocks")
    return True


def rope_write_kv(
    q: torch.Tensor,  # [T, heads * head_dim], row stride free (a column slice of the qkv projection)
    k: torch.Tensor,  # [T, kv_heads * head_dim]
    v: torch.Tensor,  # [T, kv_heads * head_dim]
    cos: torch.Tensor,  # [T, rotary_dim / 2]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], same dtype as q
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """rotary(q), rotary(k) -> (q_out, k_out) contiguous, with rotary(k) and v also stored at their cache
    slots, in one pass: what `rotary` twice and `write_kv` compute. None where it does not apply; IndexError
    for a slot outside the cache (the rotated q and k are not returned then)."""
    lib = _lib_for(q, k, v, cos, sin, k_cache, v_cache)
    if lib is None or any(_rows(x) is None for x in (q, k, v)) or slot_mapping.dtype != torch.int64:
        return None
    kv_heads = k_cache.shape[-2]
    if (
        not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k_cache.shape[-1] != head_dim
        or k.shape[1] != kv_heads * head_dim
        or v.shape[1] != k.shape[1]
        or q.shape[1] % head_dim
    ):
        return None
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
    rows = q.shape[0]
    q_out = torch.empty(rows, q.shape[1], dtype=q.dtype)
    k_out = torch.empty(rows, k.shape[1], dtype=k.dtype)
    bad = getattr(lib, f"rope_write_kv_{_SUFFIX[q.dtype]}")(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        q_out.data_ptr(),
        k_out.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        k_cache.numel() // (kv_heads * head_dim),
        rows,
        q.shape[1] // head_dim,
        kv_heads,
        head_dim,
        cos.shape[-1],
        torch.get_num_threads(),
    )
    if bad:
        raise IndexError(f"{bad} KV-cache slot(s) outside the cache of {k_cache.shape[0]} blocks")
    return q_out, k_out


def gather_rows(table: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """table[idx].to(dtype) in one kernel call ([R, W] float32 / bfloat16 table, [T] int64 ids -> [T, W]): the
    embedding lookup and the rotary cos / sin rows of a step. None where it does not apply; IndexError for
    an id outside the table."""
    if not _enabled or table.device.type != "cpu" or idx.device.type != "cpu":
        return None
    if table.dtype not in _SUFFIX or dtype not in _SUFFIX or idx.dtype != torch.int64 or idx.dim() != 1:
        return None
    if table.dim() != 2 or not table.is_contiguous():
        return None
    lib = load_ops_library()
    if lib is None:
        return None
    idx = idx.contiguous()
    out = torch.empty(idx.shape[0], table.shape[1], dtype=dtype)
    bad = lib.gather_rows(
        table.data_ptr(),
        int(table.dtype == torch.bfloat16),
        table.shape[0],
        table.shape[1],
        idx.data_ptr(),
        idx.shape[0],
        out.data_ptr(),
        int(dtype == torch.bfloat16),
    )
    if bad:
        raise IndexError(f"{bad} id(s) outside a table of {table.shape[0]} rows")
    return out
