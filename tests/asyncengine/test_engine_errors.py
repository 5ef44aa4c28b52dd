"""Start-up errors are typed: unknown architecture, missing weights, a KV cache too small."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from asyncengine import LLM, ConfigError, EngineConfig, ModelLoadError

pytestmark = pytest.mark.timeout(120)


def test_unknown_architecture(tiny_model_factory, tmp_path) -> None:
    src = tiny_model_factory("llama")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="MadeUpForCausalLM"):
        LLM(model=str(tmp_path), num_kv_blocks=16)


def test_missing_weight(tiny_model_factory, tmp_path) -> None:
    src = tiny_model_factory("qwen2")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    missing = next(k for k in tensors if "k_proj.weight" in k)
    del tensors[missing]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="qkv_proj|k_proj"):
        LLM(model=str(tmp_path), num_kv_blocks=16)


def test_kv_cache_too_small_and_bad_paths(tiny_model_factory, tmp_path) -> None:
    model = tiny_model_factory("llama")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(model=str(model), num_kv_blocks=2, block_size=16, max_model_len=256)
    with pytest.raises(ConfigError, match="not found"):
        EngineConfig(model=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(model=str(model), dtype="float8")
