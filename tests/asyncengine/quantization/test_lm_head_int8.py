"""--lm-head-quantization int8: the logits GEMM on int8 codes with per-vocabulary-row scales, on top of any
checkpoint. Greedy output equals HF transformers on weights rounded the same way (float32), untied and
tied heads; tensor parallelism (vocab rows split across ranks) equals one process."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ODD_SHAPES
from quant_writer import Spec
from safetensors.torch import load_file, save_file
from tiny_models import hf_greedy, load_hf

from asyncengine import SamplingParams
from asyncengine.errors import ConfigError
from asyncengine.layers.embedding import ParallelLMHead
from asyncengine.layers.parallel import ParallelContext
from asyncengine.models.loader import load_model

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[random.Random(n).randrange(3, 512) for _ in range(n)] for n in (1, 7, 33)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def round_rows(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per row, dequantized (scale = max |w| / 127 of the row)."""
    w = w.float()
    scale = w.abs().amax(1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale).clamp(-127, 127) * scale


def head_oracle(oracle: Path, dst: Path) -> Path:
    """`oracle` with its LM head rounded per row; a tied head becomes an untied, rounded copy of the
    embedding (the lookup keeps the full-precision embedding, as the engine does)."""
    tensors = load_file(str(oracle / "model.safetensors"))
    config = json.loads((oracle / "config.json").read_text())
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    tensors["lm_head.weight"] = round_rows(head).contiguous()
    config["tie_word_embeddings"] = False
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    if (oracle / "generation_config.json").exists():
        shutil.copy(oracle / "generation_config.json", dst / "generation_config.json")
    return dst


CASES: dict[str, tuple[str, Spec | None, dict[str, Any]]] = {
    "llama-int8": ("llama", None, {}),
    "llama-gptq4-g64": ("llama", Spec("gptq", 4, 64), {}),
    "qwen2-int8-tied": ("qwen2", None, {"tie_word_embeddings": True}),
}


def chosen_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = load_hf(model_dir)(torch.tensor([prompt + completion])).logits[0]
    rows = logits[len(prompt) - 1 : -1].log_softmax(-1)
    return [rows[i, t].item() for i, t in enumerate(completion)]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logprobs_match_hf_with_the_head_rounded(
    case: str, quantized_factory: Any, llm_factory: Any, tmp_path: Path
) -> None:
    arch, spec, overrides = CASES[case]
    quantized, oracle = quantized_factory(arch, spec, **ODD_SHAPES, **overrides)
    rounded = head_oracle(oracle, tmp_path / "oracle")
    llm = llm_factory(quantized, quantization="int8" if spec is None else None, lm_head_quantization="int8")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in outs] == hf_greedy(rounded, PROMPTS, 10)
    # greedy tokens rarely tell a rounded head from the exact one; log-probabilities do (float32: the
    # engine is within 1e-5 of the rounded head's, 20x further from the exact head's)
    prompt, out = PROMPTS[-1], outs[-1]
    got = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]
    want = chosen_logprobs(rounded, prompt, out.token_ids)
    exact = chosen_logprobs(oracle, prompt, out.token_ids)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5  # measured <= 5e-7
    assert max(abs(a - b) for a, b in zip(got, exact)) > 5e-5  # measured 2e-4 to 3e-3


def test_head_holds_int8_codes_only(quantized_factory: Any) -> None:
    path, _ = quantized_factory("llama", None, **ODD_SHAPES)
    model = load_model(
        str(path), ParallelContext(), torch.float32, torch.device("cpu"), lm_head_quantization="int8"
    )
    (head,) = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    assert head.quant_weight is not None and head.weight.numel() == 0  # untied: no float copy kept


def test_only_int8_is_accepted(quantized_factory: Any) -> None:
    path, _ = quantized_factory("llama", None, **ODD_SHAPES)
    from asyncengine import EngineConfig

    with pytest.raises(ConfigError, match="lm_head_quantization"):
        EngineConfig(model=str(path), lm_head_quantization="int4")


@pytest.mark.slow
def test_tensor_parallel_equals_one_process(quantized_factory: Any, llm_factory: Any) -> None:
    path, _ = quantized_factory("llama", None, **ODD_SHAPES)
    common = dict(quantization="int8", lm_head_quantization="int8", num_threads=1, num_kv_blocks=64)
    single = llm_factory(path, **common)
    expected = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
    single.shutdown()
    tp = llm_factory(path, tensor_parallel_size=2, **common)
    assert [o.outputs[0].token_ids for o in tp.generate(PROMPTS, GREEDY)] == expected
