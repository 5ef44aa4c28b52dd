"""Random-initialised tiny HF models, built with from_config + save_pretrained (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")


def hf_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    hidden = overrides.pop("hidden_size", 64)
    layers = overrides.pop("num_hidden_layers", 2)
    heads = overrides.pop("num_attention_heads", 4)
    kv_heads = overrides.pop("num_key_value_heads", 2)
    vocab = overrides.pop("vocab_size", 512)
    max_pos = overrides.pop("max_position_embeddings", 1024)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=max_pos,
            bos_token_id=1, eos_token_id=2, **overrides,
        )
        cfg.architectures = ["GPT2LMHeadModel"]
        return cfg
    common = dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        vocab_size=vocab, max_position_embeddings=max_pos, intermediate_size=overrides.pop("intermediate_size", 128),
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=overrides.pop("tie_word_embeddings", False),
    )
    common.update(overrides)
    cls, arch_name = {
        "llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
        "mistral": (transformers.MistralConfig, "MistralForCausalLM"),
        "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM"),
        "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM"),
    }[arch]
    cfg = cls(**common)
    cfg.architectures = [arch_name]
    return cfg


def build_tiny_model(arch: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """Saves a random model of `arch` to `path` and returns the directory."""
    cfg = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # random init leaves biases at zero; make them non-trivial so bias handling is actually checked
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf(path: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()
