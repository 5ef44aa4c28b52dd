"""A model directory's config.json, read without torch or transformers.

The engine process needs a handful of fields (max positions, vocab size, EOS ids) and reads them
here: `transformers.AutoConfig` imports torch (transformers >= 5), seconds of a cold start. The object
is the JSON's keys as attributes, plus the attribute aliases transformers gives GPT-2's config
(hidden_size -> n_embd, ...), so `getattr(cfg, "vocab_size", 0)` reads as on a PretrainedConfig;
fields absent from the file have no value (transformers would supply its per-class defaults).

Workers load the model from the same object when `is_self_contained` says the file spells out every
field the model code reads (models/loader.get_model_config); anything else goes through transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncengine.errors import ModelLoadError

# transformers' `attribute_map` of the configs whose names differ from the Llama family's
ATTRIBUTE_MAPS: dict[str, dict[str, str]] = {
    "gpt2": {
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    },
}

# The config.json keys each model family's code reads without a fallback, or whose fallback
# (the model code's getattr default) could differ from transformers' class default: when all are
# present, the JSON values are the values transformers would hand the model code.
SELF_CONTAINED_KEYS: dict[str, tuple[str, ...]] = {
    "llama": (
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
    ),
    "gpt2": (
        "architectures",
        "vocab_size",
        "n_embd",
        "n_layer",
        "n_head",
        "n_positions",
        "n_inner",
        "activation_function",
        "layer_norm_epsilon",
        "scale_attn_weights",
        "scale_attn_by_inverse_layer_idx",
    ),
}


class ModelConfig:
    """config.json's keys as attributes (see the module docstring)."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.__dict__.update(raw)

    def __getattr__(self, name: str) -> Any:  # only for names that are not keys of the file
        alias = ATTRIBUTE_MAPS.get(self.__dict__.get("model_type", ""), {}).get(name)
        if alias is not None and alias in self.__dict__:
            return self.__dict__[alias]
        raise AttributeError(f"the model config has no {name!r}")

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__!r})"


def read_model_config(model_dir: str) -> ModelConfig:
    """The directory's config.json; ModelLoadError when it is missing or not a JSON object."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # no such file, a directory, not JSON, not UTF-8
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"cannot read the model config in {model_dir}: config.json is not a JSON object")
    return ModelConfig(raw)


def model_max_len(hf_config: Any) -> int:
    """The longest context the model supports (a sliding window does not shorten it: the attention
    layers honour the window, see llama.sliding_window_of). Takes a ModelConfig or a transformers config."""
    max_len = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if not max_len:
        raise ModelLoadError("the model config has neither max_position_embeddings nor n_positions")
    return int(max_len)


def is_self_contained(cfg: ModelConfig) -> bool:
    """Whether the model code may read `cfg` as it is, instead of transformers' config for it: a family
    listed in SELF_CONTAINED_KEYS whose file has all those keys, and plain RoPE (the scaled variants
    are computed by transformers' functions, which want transformers' config object)."""
    raw = vars(cfg)
    keys = SELF_CONTAINED_KEYS.get(raw.get("model_type", ""))
    if keys is None or any(k not in raw for k in keys):
        return False
    if raw["model_type"] == "gpt2":
        return True
    rope = raw.get("rope_parameters")
    if rope is None:  # written by transformers 4.x: rope_theta (+ rope_scaling)
        return "rope_theta" in raw and not raw.get("rope_scaling")
    return (
        isinstance(rope, dict)
        and "rope_theta" in rope
        and (rope.get("rope_type") or rope.get("type") or "default") == "default"
        and not raw.get("rope_scaling")
    )
