"""model_config: config.json without torch or transformers, and the self-contained configs workers
read as they are: for those, everything the model code derives from the config equals what it
derives from transformers' config of the same file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tiny_models import hf_config

from asyncengine.config import default_model_path
from asyncengine.errors import ModelLoadError
from asyncengine.layers.parallel import ParallelContext
from asyncengine.layers.rotary import max_rope_positions, rope_parameters
from asyncengine.model_config import ModelConfig, is_self_contained, model_max_len, read_model_config
from asyncengine.models import loader
from asyncengine.models.llama import LlamaForCausalLM, head_dim_of, sliding_window_of

LLAMA_ATTRS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
)
GPT2_ATTRS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "n_layer",
    "n_embd",
    "activation_function",
    "layer_norm_epsilon",
)
GETATTR_DEFAULTS = {
    "num_key_value_heads": None,
    "tie_word_embeddings": None,
    "n_inner": None,
    "head_dim": None,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "sliding_window": None,
    "partial_rotary_factor": None,
}


def saved(tmp_path: Path, cfg: transformers.PretrainedConfig) -> Path:
    cfg.save_pretrained(tmp_path)
    return tmp_path


def derived(cfg: Any) -> dict[str, Any]:
    """What the model code and the worker read from a config."""
    gpt2 = hasattr(cfg, "n_embd")
    out = {a: getattr(cfg, a) for a in (GPT2_ATTRS if gpt2 else LLAMA_ATTRS)}
    out.update({a: getattr(cfg, a, d) for a, d in GETATTR_DEFAULTS.items()})
    out.update(max_len=model_max_len(cfg), dtype=loader.model_dtype(cfg), head_cost=loader.lm_head_cost(cfg))
    if not gpt2:
        layers = range(cfg.num_hidden_layers)
        out.update(
            head_dim=head_dim_of(cfg),
            windows=[sliding_window_of(cfg, i) for i in layers],
            rope=rope_parameters(cfg),
            rope_positions=max_rope_positions(cfg),
            options=LlamaForCausalLM.options(cfg),
        )
    return out


CONFIGS = {
    "llama": lambda: hf_config("llama"),
    "llama tied, biased, rope_theta": lambda: hf_config(
        "llama",
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        rope_theta=500000.0,
        head_dim=32,
    ),
    "gpt2": lambda: hf_config("gpt2"),
    "gpt2 n_inner, scaled": lambda: hf_config(
        "gpt2", n_inner=96, scale_attn_by_inverse_layer_idx=True, activation_function="gelu"
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_self_contained_configs_read_as_transformers_reads_them(name: str, tmp_path: Path) -> None:
    path = saved(tmp_path, CONFIGS[name]())
    cfg = loader.get_model_config(str(path))
    assert isinstance(cfg, ModelConfig)  # transformers' config machinery not needed
    hf = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    assert derived(cfg) == derived(hf)


def test_default_model_config(tmp_path: Path) -> None:
    cfg = loader.get_model_config(default_model_path())
    assert isinstance(cfg, ModelConfig)
    assert derived(cfg) == derived(transformers.AutoConfig.from_pretrained(default_model_path()))


def test_models_built_from_either_config_are_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiny_models import build_tiny_model

    for arch in ("llama", "gpt2"):
        path = build_tiny_model(arch, tmp_path / arch)
        assert isinstance(loader.get_model_config(str(path)), ModelConfig)
        ours = loader.load_model(str(path), ParallelContext(), torch.float32, torch.device("cpu"))
        with monkeypatch.context() as m:
            m.setattr(loader, "is_self_contained", lambda cfg: False)
            theirs = loader.load_model(str(path), ParallelContext(), torch.float32, torch.device("cpu"))
        assert not isinstance(theirs.config, ModelConfig)
        a, b = ours.state_dict(), theirs.state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), arch
        assert [(n, tuple(t.shape)) for n, t in ours.named_buffers()] == [
            (n, tuple(t.shape)) for n, t in theirs.named_buffers()
        ]
        assert all(torch.equal(x, y) for x, y in zip(ours.buffers(), theirs.buffers()))


NOT_SELF_CONTAINED = {
    "mistral (sliding-window defaults)": lambda: hf_config("mistral"),
    "qwen2": lambda: hf_config("qwen2"),
    "qwen3": lambda: hf_config("qwen3"),
    "llama3 rope scaling": lambda: hf_config(
        "llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
            "rope_theta": 10000.0,
        },
    ),
    "linear rope scaling": lambda: hf_config(
        "llama", rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    ),
}


@pytest.mark.parametrize("name", list(NOT_SELF_CONTAINED))
def test_other_configs_go_through_transformers(name: str, tmp_path: Path) -> None:
    path = saved(tmp_path, NOT_SELF_CONTAINED[name]())
    assert not is_self_contained(read_model_config(str(path)))
    cfg = loader.get_model_config(str(path))
    assert isinstance(cfg, transformers.PretrainedConfig)


def test_a_missing_key_means_transformers(tmp_path: Path) -> None:
    path = saved(tmp_path, hf_config("llama"))
    raw = json.loads((path / "config.json").read_text())
    del raw["rms_norm_eps"]  # transformers would supply LlamaConfig's default
    (path / "config.json").write_text(json.dumps(raw))
    assert not is_self_contained(read_model_config(str(path)))


def test_legacy_rope_theta_config_is_self_contained(tmp_path: Path) -> None:
    """A transformers 4.x config.json: rope_theta at the top, no rope_parameters."""
    path = saved(tmp_path, hf_config("llama"))
    raw = json.loads((path / "config.json").read_text())
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"] * 2
    raw["rope_scaling"] = None
    (path / "config.json").write_text(json.dumps(raw))
    cfg = read_model_config(str(path))
    assert is_self_contained(cfg)
    assert derived(cfg) == derived(transformers.AutoConfig.from_pretrained(str(path)))


def test_gpt2_aliases_and_missing_attributes() -> None:
    cfg = ModelConfig({"model_type": "gpt2", "n_embd": 64, "n_positions": 128, "n_head": 4, "n_layer": 2})
    assert (cfg.hidden_size, cfg.max_position_embeddings, cfg.num_attention_heads, cfg.num_hidden_layers) == (
        64,
        128,
        4,
        2,
    )
    assert getattr(cfg, "vocab_size", 0) == 0
    with pytest.raises(AttributeError):
        _ = cfg.hidden_act
    assert not hasattr(
        ModelConfig({"model_type": "llama", "n_embd": 1}), "hidden_size"
    )  # aliases are per type


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]"])
def test_unreadable_configs_are_model_load_errors(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelLoadError, match="cannot read the model config"):
        read_model_config(str(tmp_path))
    with pytest.raises(ModelLoadError, match="cannot read the model config"):
        loader.get_model_config(str(tmp_path))
