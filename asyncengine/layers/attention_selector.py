"""Which attention backend a process uses: chosen by name or by device, held for every Attention layer.

Sits above the backends (it builds them) and below the Attention layer (which asks it for the backend
on every call); the backends never import it.
"""

from __future__ import annotations

import importlib.util

import torch

from asyncengine.layers.attention_backend import AttentionBackend
from asyncengine.layers.attention_cpu import CpuAttentionBackend
from asyncengine.layers.attention_torch import TorchAttentionBackend

_backend: AttentionBackend | None = None


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called `name` (torch, cpu or triton); for "auto", Triton on CUDA (when installed) and
    the compiled CPU kernel on CPU."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if importlib.util.find_spec("triton") else "torch"
        else:
            name = "cpu"
    if name == "cpu":
        return CpuAttentionBackend()
    if name == "triton":
        # imported here, not above: importing triton costs ~0.2 s, which a CPU worker never needs to pay
        from asyncengine.layers.attention_triton import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()


def set_attention_backend(backend: AttentionBackend) -> None:
    """Chosen once per worker process, before the first forward."""
    global _backend
    _backend = backend


def get_attention_backend() -> AttentionBackend:
    """The backend set for this process; with none set (tests, tools that build a model directly), the
    reference backend, which is exact and runs on any device."""
    global _backend
    if _backend is None:
        _backend = TorchAttentionBackend()
    return _backend
