"""Token sampling on CPU in C (csrc/sampling.c): temperature, top-k, top-p and min-p without sorting the
vocabulary or drawing a random number per token.

The torch path (layers/sampler.py) draws an exponential variate per vocabulary entry (the exponential
race) and sorts every row for top-k / top-p: at batch 64 x 32000 that is ~46 ms a step for plain
temperature sampling and ~110 ms with top-p, against a ~50 ms decode step. The kernel takes one uniform
number a row, drawn by the caller from the row's generator (so seeded requests stay reproducible in any
batch), and samples by inverse CDF over the filtered distribution; cuts are found by radix selection.

`sample_rows` returns None where it does not apply (not a CPU tensor, a dtype other than float32 /
bfloat16, no compiler, or ASYNCENGINE_CPU_SAMPLER=0) and the caller samples with torch.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import torch

from asyncengine.cpu.build import build_library

SOURCE = Path(__file__).parent / "csrc" / "sampling.c"
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_enabled = os.environ.get("ASYNCENGINE_CPU_SAMPLER", "1") != "0"


@cache
def load_sampling_library(portable: bool = False) -> ctypes.CDLL | None:
    lib = build_library(SOURCE, portable)
    if lib is None:
        return None
    for suffix in _SUFFIX.values():
        fn = getattr(lib, f"sample_rows_{suffix}")
        fn.restype = _I
        fn.argtypes = [_P, _L, _I, _I, _P, _P, _P, _P, _P, _P, _I]
    return lib


def applies(logits: torch.Tensor) -> bool:
    """Whether sample_rows takes these logits (so that callers draw its uniforms only then)."""
    return (
        _enabled
        and logits.device.type == "cpu"
        and logits.dtype in _SUFFIX
        and logits.dim() == 2
        and logits.stride(1) == 1
        and 0 < logits.shape[1] < 2**31
        and load_sampling_library() is not None
    )


def sample_rows(
    logits: torch.Tensor,  # [N, V] float32 or bfloat16, unit stride along V
    temperature: list[float],  # 0: greedy (the row's first maximum)
    top_k: list[int],  # 0: off
    top_p: list[float],  # 1: off
    min_p: list[float],  # 0: off
    uniform: torch.Tensor,  # [N] float64 in [0, 1): one draw a row
    portable: bool = False,  # the plain-C build (tests)
) -> torch.Tensor | None:
    """[N] int64 token ids, or None where the kernel does not apply."""
    lib = load_sampling_library(portable) if applies(logits) else None
    if lib is None:
        return None
    n = logits.shape[0]
    temps = torch.tensor(temperature, dtype=torch.float32)
    ks = torch.tensor(top_k, dtype=torch.int32)
    ps = torch.tensor(top_p, dtype=torch.float32)
    mps = torch.tensor(min_p, dtype=torch.float32)
    u = uniform.to(torch.float64).contiguous()
    assert temps.numel() == ks.numel() == ps.numel() == mps.numel() == u.numel() == n
    out = torch.empty(n, dtype=torch.int64)
    rc = getattr(lib, f"sample_rows_{_SUFFIX[logits.dtype]}")(
        logits.data_ptr(),
        logits.stride(0),
        n,
        logits.shape[1],
        temps.data_ptr(),
        ks.data_ptr(),
        ps.data_ptr(),
        mps.data_ptr(),
        u.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("sample_rows: no memory for its scratch rows")
    return out
