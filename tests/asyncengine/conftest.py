"""Fixtures for engine tests: tiny models on disk and engines that are always shut down."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiny_models import build_tiny_model, build_tiny_model_with_tokenizer

from asyncengine import LLM


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[tuple, Path] = {}

    def make(arch: str, tokenizer: bool = False, **overrides: Any) -> Path:
        key = (arch, tokenizer, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-model")
            builder = build_tiny_model_with_tokenizer if tokenizer else build_tiny_model
            cache[key] = builder(arch, path, **overrides)
        return cache[key]

    return make


@pytest.fixture
def llm_factory() -> Iterator[Any]:
    started: list[LLM] = []

    def make(model: Path, **kwargs: Any) -> LLM:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("num_kv_blocks", 256)
        llm = LLM(model=str(model), **kwargs)
        started.append(llm)
        return llm

    yield make
    for llm in started:
        llm.shutdown()
