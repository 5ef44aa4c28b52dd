"""asyncengine: an LLM inference engine with an asyncio control plane over one worker per device."""

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

__all__ = [
    "AsyncEngine", "AsyncEngineError", "CompletionOutput", "ConfigError", "EngineConfig", "EngineDeadError",
    "EngineShutdownError", "InvalidRequestError", "LLM", "Logprob", "ModelLoadError", "OutputKind", "RequestOutput",
    "SamplingParams", "SamplingParamsError",
]
