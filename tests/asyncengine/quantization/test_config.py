"""quantization_config parsing: what is read, and a ConfigError naming anything else, raised in the engine
process (torch-free) before a worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.quantization.config import parse_quant_config


def test_unquantized_is_none_and_int8_and_int4_apply_at_load_time() -> None:
    assert parse_quant_config(None) is None
    cfg = parse_quant_config(None, "int8")
    assert (cfg.method, cfg.bits, cfg.group_size) == ("int8", 8, -1)
    cfg = parse_quant_config(None, "int4")
    assert (cfg.method, cfg.bits, cfg.group_size, cfg.sym) == ("int4", 4, 32, False)


def test_gptq_fields_and_its_v1_zero_convention() -> None:
    raw = {"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": True, "sym": False}
    cfg = parse_quant_config(raw)
    assert (cfg.bits, cfg.group_size, cfg.desc_act, cfg.sym, cfg.zero_minus_one) == (8, 64, True, False, True)
    assert not parse_quant_config(dict(raw, checkpoint_format="gptq_v2")).zero_minus_one
    assert parse_quant_config(dict(raw, group_size=-1)).group_size == -1


def test_fp8_block_scales_and_compressed_tensors() -> None:
    fp8 = parse_quant_config({"quant_method": "fp8", "weight_block_size": [128, 64]})
    assert fp8.fp8_block == (128, 64) and fp8.group_size == 64
    ct = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head"],
    }
    cfg = parse_quant_config(ct)
    assert (cfg.method, cfg.bits, cfg.group_size, cfg.sym) == ("compressed-tensors", 4, 32, True)


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
        ({"quant_method": "gptq", "bits": 3}, "3 bits"),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "awq", "version": "gemv"}, "gemv"),
        ({"quant_method": "awq", "bits": 8}, "8 bits"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "float-quantized"),
    ],
)
def test_unsupported_methods_name_themselves_and_the_supported_ones(raw: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named) as info:
        parse_quant_config(raw)
    assert "supported: gptq" in str(info.value)


def test_int8_flag_on_a_quantized_checkpoint_and_unknown_flags_are_refused() -> None:
    with pytest.raises(ConfigError, match="already gptq"):
        parse_quant_config({"quant_method": "gptq"}, "int8")
    with pytest.raises(ConfigError, match="already gptq"):
        parse_quant_config({"quant_method": "gptq"}, "int4")
    with pytest.raises(ConfigError, match="quantization must be one of"):
        parse_quant_config(None, "int2")


def test_engine_config_refuses_before_any_worker_starts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "hqq"}}))
    with pytest.raises(ConfigError, match="hqq"):
        EngineConfig(model=str(tmp_path))
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(model=str(tmp_path.parent), quantization="int3")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    assert EngineConfig(model=str(tmp_path)).quantization is None
