"""asyncengine: an LLM inference engine with an asyncio control plane over one worker per device.

Names are imported lazily, so `asyncengine --help` and worker processes don't pay for the engine,
transformers and the server stack until they use them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncEngine": "asyncengine.engine",
    "EngineConfig": "asyncengine.config",
    "LLM": "asyncengine.llm",
    "SamplingParams": "asyncengine.sampling_params",
    "SamplingParamsError": "asyncengine.sampling_params",
    "OutputKind": "asyncengine.sampling_params",
    "RequestOutput": "asyncengine.outputs",
    "CompletionOutput": "asyncengine.outputs",
    "Logprob": "asyncengine.outputs",
    "AsyncEngineError": "asyncengine.errors",
    "ConfigError": "asyncengine.errors",
    "EngineDeadError": "asyncengine.errors",
    "EngineShutdownError": "asyncengine.errors",
    "InvalidRequestError": "asyncengine.errors",
    "ModelLoadError": "asyncengine.errors",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "AsyncEngineError",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "EngineDeadError",
    "EngineShutdownError",
    "InvalidRequestError",
    "Logprob",
    "ModelLoadError",
    "OutputKind",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
]

if TYPE_CHECKING:
    from asyncengine.config import EngineConfig
    from asyncengine.engine import AsyncEngine
    from asyncengine.errors import (
        AsyncEngineError,
        ConfigError,
        EngineDeadError,
        EngineShutdownError,
        InvalidRequestError,
        ModelLoadError,
    )
    from asyncengine.llm import LLM
    from asyncengine.outputs import CompletionOutput, Logprob, RequestOutput
    from asyncengine.sampling_params import OutputKind, SamplingParams, SamplingParamsError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncengine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
