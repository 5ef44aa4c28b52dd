"""Quantized tiny checkpoints and their float32 oracles, written once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from quant_writer import Spec, load_time_method, write_checkpoint, write_load_time_oracle

# hidden 96 and intermediate 160 are not multiples of 64 or 128 (partial last groups), and tensor-parallel
# halves (48, 80) are not multiples of 32 or 64 (shards that cut groups)
ODD_SHAPES: dict[str, Any] = {
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture(scope="session")
def quantized_factory(tiny_model_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(arch, spec, **model overrides) -> (quantized checkpoint, float32 oracle checkpoint). spec: a Spec
    (a pre-quantized checkpoint), or "int8" / "int4" (None: "int8") for --quantization at load time."""
    cache: dict[tuple, tuple[Path, Path]] = {}

    def make(arch: str, spec: Spec | str | None, **overrides: Any) -> tuple[Path, Path]:
        key = (arch, spec, tuple(sorted(overrides.items())))
        if key not in cache:
            src = tiny_model_factory(arch, **overrides)
            method = load_time_method(spec)
            root = tmp_path_factory.mktemp(f"{arch}-{method or spec.fmt}")  # type: ignore[union-attr]
            if method is not None:  # --quantization int8 / int4: the model is the float checkpoint itself
                cache[key] = (src, write_load_time_oracle(src, root / "oracle", method))
            else:
                cache[key] = write_checkpoint(src, root / "quantized", root / "oracle", spec)  # type: ignore[arg-type]
        return cache[key]

    return make
