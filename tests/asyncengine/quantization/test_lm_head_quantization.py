"""--lm-head-quantization int8 | int4: the logits GEMM on int8 codes with per-vocabulary-row scales, or on
4-bit codes with a scale and minimum per row and 32 hidden columns, on top of any checkpoint. Greedy
output equals HF transformers on weights rounded the same way (float32), untied and tied heads; tensor
parallelism (vocab rows split across ranks) equals one process."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ODD_SHAPES
from quant_writer import LOAD_TIME_ROUNDING, Spec, round_int4_groups
from safetensors.torch import load_file, save_file
from tiny_models import hf_greedy, load_hf

from asyncengine import SamplingParams
from asyncengine.errors import ConfigError
from asyncengine.layers.embedding import ParallelLMHead
from asyncengine.layers.parallel import ParallelContext
from asyncengine.models.loader import load_model
from asyncengine.quantization import kernels
from asyncengine.quantization.int4 import quantize_groups

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[random.Random(n).randrange(3, 512) for _ in range(n)] for n in (1, 7, 33)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def head_oracle(oracle: Path, dst: Path, method: str) -> Path:
    """`oracle` with its LM head rounded as `method` rounds it; a tied head becomes an untied, rounded copy
    of the embedding (the lookup keeps the full-precision embedding, as the engine does)."""
    tensors = load_file(str(oracle / "model.safetensors"))
    config = json.loads((oracle / "config.json").read_text())
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    tensors["lm_head.weight"] = LOAD_TIME_ROUNDING[method](head).contiguous()
    config["tie_word_embeddings"] = False
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    if (oracle / "generation_config.json").exists():
        shutil.copy(oracle / "generation_config.json", dst / "generation_config.json")
    return dst


CASES: dict[str, tuple[str, Spec | None, dict[str, Any], str]] = {
    "llama-int8": ("llama", None, {}, "int8"),
    "llama-gptq4-g64": ("llama", Spec("gptq", 4, 64), {}, "int8"),
    "qwen2-int8-tied": ("qwen2", None, {"tie_word_embeddings": True}, "int8"),
    "llama-int8-head4": ("llama", None, {}, "int4"),
    "llama-gptq4-g64-head4": ("llama", Spec("gptq", 4, 64), {}, "int4"),
    "qwen2-int8-tied-head4": ("qwen2", None, {"tie_word_embeddings": True}, "int4"),
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
    arch, spec, overrides, head = CASES[case]
    quantized, oracle = quantized_factory(arch, spec, **ODD_SHAPES, **overrides)
    rounded = head_oracle(oracle, tmp_path / "oracle", head)
    llm = llm_factory(quantized, quantization="int8" if spec is None else None, lm_head_quantization=head)
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


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_head_holds_codes_only(quantized_factory: Any, method: str) -> None:
    path, _ = quantized_factory("llama", None, **ODD_SHAPES)
    model = load_model(
        str(path), ParallelContext(), torch.float32, torch.device("cpu"), lm_head_quantization=method
    )
    (head,) = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    assert head.quant_weight is not None and head.weight.numel() == 0  # untied: no float copy kept


@pytest.mark.parametrize("shape", [(100, 75), (64, 96), (7, 31), (33, 1)])
def test_int4_groups_round_trip_and_multiply(shape: tuple[int, int]) -> None:
    """Odd widths (a short last group) included: the codes dequantize to the reference rounding, and the
    kernels' product with them equals float32 math on the dequantized weight."""
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * 0.1
    w[0] = 0.0  # an all-zero row stays zero
    codes = quantize_groups(w)
    assert int(codes.codes.max()) <= 15 and codes.scales.shape == (-(-shape[1] // 32), shape[0])
    dequant = codes.dequantize()
    torch.testing.assert_close(dequant, round_int4_groups(w), rtol=0, atol=1e-6)
    assert not dequant[0].any()
    canonical = codes.canonical()
    torch.testing.assert_close(canonical.dequantize_original(), dequant, rtol=0, atol=1e-6)
    x = torch.randn(5, shape[1], generator=gen)
    got = kernels.linear(x, kernels.prepare(canonical, torch.device("cpu")), None)
    torch.testing.assert_close(got, x @ dequant.t(), rtol=1e-5, atol=1e-5)


def test_an_unknown_method_is_refused(quantized_factory: Any) -> None:
    path, _ = quantized_factory("llama", None, **ODD_SHAPES)
    from asyncengine import EngineConfig

    with pytest.raises(ConfigError, match="lm_head_quantization"):
        EngineConfig(model=str(path), lm_head_quantization="int2")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tensor_parallel_equals_one_process(quantized_factory: Any, llm_factory: Any, method: str) -> None:
    path, _ = quantized_factory("llama", None, **ODD_SHAPES)
    common = dict(quantization="int8", lm_head_quantization=method, num_threads=1, num_kv_blocks=64)
    single = llm_factory(path, **common)
    expected = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
    single.shutdown()
    tp = llm_factory(path, tensor_parallel_size=2, **common)
    assert [o.outputs[0].token_ids for o in tp.generate(PROMPTS, GREEDY)] == expected
