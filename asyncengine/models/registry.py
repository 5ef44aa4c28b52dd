"""Maps a HF config's `architectures` entry to the model class that implements it."""

from __future__ import annotations

from typing import Any

from asyncengine.errors import ModelLoadError
from asyncengine.models.base import CausalLM
from asyncengine.models.gpt2 import GPT2LMHeadModel
from asyncengine.models.llama import LlamaForCausalLM, MistralForCausalLM
from asyncengine.models.qwen2 import Qwen2ForCausalLM
from asyncengine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def resolve_model_class(hf_config: Any) -> type[CausalLM]:
    """The first of the config's architectures we implement; ModelLoadError when there is none."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ModelLoadError(
        f"unknown architecture {architectures or '(none in config.json)'}; "
        f"supported: {', '.join(MODEL_REGISTRY)}"
    )
