"""The default model's real tokenizer, grammar compilers over it (its vocab, and one padded), and
generate(): a constrained "model" of random logits, its masks applied as the worker will."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine.config import default_model_path
from asyncengine.layers.grammar_mask import apply_token_bitmask_, bitmask_from_bytes
from asyncengine.structured_output import GrammarCompiler, StructuredOutputsParams, allocate_bitmask
from asyncengine.tokenizer import eos_token_ids, load_tokenizer

Generate = Callable[[GrammarCompiler, StructuredOutputsParams, int], str]

PADDED_VOCAB = 4096 + 64  # as if the model's embedding were padded past the tokenizer's 4096


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def vocab_size() -> int:
    return json.loads((Path(default_model_path()) / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="session")
def eos_ids(tokenizer: Any) -> list[int]:
    return sorted(eos_token_ids(default_model_path(), tokenizer))


@pytest.fixture(scope="session")
def compiler(tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size, eos_ids)


@pytest.fixture(scope="session")
def padded_compiler(tokenizer: Any, eos_ids: list[int]) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, PADDED_VOCAB, eos_ids)


@pytest.fixture(scope="session")
def bonus(tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> torch.Tensor:
    """Added to random logits so that constrained walks end: random logits would wander in a string for
    thousands of tokens, so tokens that close things (quotes, brackets, commas, spaces, EOS) get +3,
    and whitespace-only tokens -5 (JSON's flexible whitespace is a bottomless well for a model that
    likes it, as an untrained one may)."""
    closing = torch.zeros(vocab_size)
    for t in range(len(tokenizer)):
        text = tokenizer.decode([t])
        if not text.strip():
            closing[t] = -5.0
        elif any(c in text for c in '"}],; '):
            closing[t] = 3.0
    closing[eos_ids] = 3.0
    return closing


@pytest.fixture(scope="session")
def generate(tokenizer: Any, eos_ids: list[int], bonus: torch.Tensor) -> Generate:
    def run(compiler: GrammarCompiler, params: StructuredOutputsParams, seed: int) -> str:
        """Greedy decoding of seeded random logits under `params`; the text before EOS."""
        gen = torch.Generator().manual_seed(seed)
        matcher = compiler.matcher(params)
        bitmask = allocate_bitmask(1, compiler.vocab_size)
        out: list[int] = []
        for _ in range(400):
            matcher.fill_bitmask(bitmask)
            logits = torch.randn(1, bonus.shape[0], generator=gen) + bonus
            # as the step message carries it: bytes
            apply_token_bitmask_(logits, bitmask_from_bytes(bitmask.tobytes(), 1))
            token = int(logits.argmax())
            assert matcher.accept_token(token), tokenizer.decode([*out, token])
            if token in eos_ids:
                assert matcher.is_terminated()
                return tokenizer.decode(out)
            out.append(token)
        raise AssertionError(f"no EOS in 400 steps: {tokenizer.decode(out)!r}")

    return run
