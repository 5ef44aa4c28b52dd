"""A checkpoint's `quantization_config` (or `--quantization int8`) read into one frozen QuantConfig.

Torch-free, so the engine process can reject an unsupported checkpoint before any worker starts. What
each field means for the tensors on disk is in the method's module (gptq.py, awq.py, fp8.py,
compressed.py, int8.py, int4.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncengine.errors import ConfigError

# --quantization: methods applied at load time to an unquantized (bf16 / fp16 / fp32) checkpoint
LOAD_TIME_METHODS = ("int8", "int4")
INT4_GROUP_SIZE = 32  # --quantization int4 (quantization/int4.py): as llama.cpp's 4-bit blocks
SUPPORTED = (
    "gptq (4/8-bit, group 32/64/128/per-channel, sym/asym, desc_act), awq (GEMM, 4-bit), "
    "fp8 (e4m3; per-tensor, per-channel or block scales), compressed-tensors (pack-quantized W4A16/W8A16), "
    "and --quantization int8 / int4 for unquantized checkpoints"
)


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's linear layers are quantized (weights only; activations stay in the model dtype)."""

    method: str  # gptq | awq | fp8 | compressed-tensors | int8 | int4
    bits: int  # 4 or 8
    group_size: int  # input features per scale; -1: one scale per output channel
    sym: bool = True
    desc_act: bool = False  # GPTQ act-order: groups follow the checkpoint's g_idx, not k // group_size
    zero_minus_one: bool = False  # GPTQ v1 files store zero - 1 (AutoGPTQ's historical convention)
    fp8_block: tuple[int, int] | None = None  # fp8 weight_block_size [out, in]: weight_scale_inv blocks

    @property
    def pack_factor(self) -> int:
        """Values per int32 in the packed tensors."""
        return 32 // self.bits


def _unsupported(what: str) -> ConfigError:
    return ConfigError(f"unsupported quantization: {what}; supported: {SUPPORTED}")


def _bits(raw: dict[str, Any], key: str, method: str) -> int:
    bits = int(raw.get(key, 4))
    if bits not in (4, 8):
        raise _unsupported(f"{method} with {bits} bits")
    return bits


def _group(value: Any, method: str) -> int:
    group = -1 if value is None else int(value)
    if group != -1 and group < 1:
        raise _unsupported(f"{method} with group_size {group}")
    return group


def parse_quant_config(raw: dict[str, Any] | None, override: str | None = None) -> QuantConfig | None:
    """The QuantConfig for config.json's `quantization_config` (raw) and the --quantization flag; None
    for an unquantized model. ConfigError for anything not supported, naming it."""
    if override is not None and override not in LOAD_TIME_METHODS:
        raise ConfigError(f"quantization must be one of {LOAD_TIME_METHODS} (or unset), got {override!r}")
    if raw is None:
        if override == "int8":
            return QuantConfig(method="int8", bits=8, group_size=-1)
        if override == "int4":
            return QuantConfig(method="int4", bits=4, group_size=INT4_GROUP_SIZE, sym=False)
        return None
    if not isinstance(raw, dict):
        raise _unsupported(f"quantization_config {raw!r}")
    method = str(raw.get("quant_method", "")).lower()
    if override is not None:
        raise ConfigError(
            f"--quantization {override} is for unquantized checkpoints; this one is already {method or '?'}"
        )
    if method == "gptq":
        return _gptq(raw)
    if method == "awq":
        return _awq(raw)
    if method == "fp8":
        return _fp8(raw)
    if method == "compressed-tensors":
        return _compressed(raw)
    raise _unsupported(f"quant_method {method or '(none)'!r}")


def _gptq(raw: dict[str, Any]) -> QuantConfig:
    fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported(f"gptq checkpoint_format {fmt!r} (gptq and gptq_v2 are read)")
    if raw.get("dynamic"):
        raise _unsupported("gptq with per-module `dynamic` overrides")
    return QuantConfig(
        method="gptq",
        bits=_bits(raw, "bits", "gptq"),
        group_size=_group(raw.get("group_size", 128), "gptq"),
        sym=bool(raw.get("sym", True)),
        desc_act=bool(raw.get("desc_act", False)),
        zero_minus_one=fmt == "gptq",
    )


def _awq(raw: dict[str, Any]) -> QuantConfig:
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _unsupported(f"awq version {version!r} (the GEMM layout is read)")
    bits = int(raw.get("bits", raw.get("w_bit", 4)))
    if bits != 4:
        raise _unsupported(f"awq with {bits} bits")
    if not raw.get("zero_point", True):
        raise _unsupported("awq without zero points")
    group = _group(raw.get("group_size", raw.get("q_group_size", 128)), "awq")
    return QuantConfig(method="awq", bits=4, group_size=group, sym=False)


def _fp8(raw: dict[str, Any]) -> QuantConfig:
    fmt = str(raw.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _unsupported(f"fp8 format {fmt!r} (e4m3 is read)")
    block = raw.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(int(b) for b in block) < 1):
        raise _unsupported(f"fp8 weight_block_size {block!r}")
    return QuantConfig(
        method="fp8",
        bits=8,
        group_size=int(block[1]) if block else -1,
        fp8_block=(int(block[0]), int(block[1])) if block else None,
    )


def _compressed(raw: dict[str, Any]) -> QuantConfig:
    fmt = str(raw.get("format", "")).lower()
    if fmt != "pack-quantized":
        raise _unsupported(f"compressed-tensors format {fmt!r} (pack-quantized W4A16 / W8A16 is read)")
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise _unsupported(f"compressed-tensors with {len(groups)} config groups (one is read)")
    scheme = next(iter(groups.values()))
    weights = scheme.get("weights") or {}
    if scheme.get("input_activations") or scheme.get("output_activations"):
        raise _unsupported(
            "compressed-tensors with quantized activations (weight-only W4A16 / W8A16 is read)"
        )
    if weights.get("type", "int") != "int" or weights.get("dynamic"):
        raise _unsupported(f"compressed-tensors weights {weights!r}")
    ignore = [name for name in raw.get("ignore") or [] if not str(name).endswith("lm_head")]
    if ignore:
        raise _unsupported(f"compressed-tensors leaving modules unquantized: {ignore[:4]}")
    strategy = str(weights.get("strategy", "group")).lower()
    if strategy not in ("group", "channel"):
        raise _unsupported(f"compressed-tensors strategy {strategy!r}")
    return QuantConfig(
        method="compressed-tensors",
        bits=_bits(weights, "num_bits", "compressed-tensors"),
        group_size=_group(weights.get("group_size") if strategy == "group" else None, "compressed-tensors"),
        sym=bool(weights.get("symmetric", True)),
        desc_act=weights.get("actorder") not in (None, False, "static"),
    )
