"""The bundled default model through the engine: greedy text equals HF transformers'."""

from __future__ import annotations

import pytest
import torch
import transformers

from asyncengine import LLM, SamplingParams
from asyncengine.config import default_model_path

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):"]


def test_default_model_greedy_matches_hf() -> None:
    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            out = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
            expected.append(out[0, ids.shape[1] :].tolist())
    llm = LLM(dtype="float32", num_kv_blocks=64)  # no model argument: the bundled default
    try:
        got = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    finally:
        llm.shutdown()
    for g, e in zip(got, expected):
        # HF stops at EOS and includes it; the engine reports the EOS token too
        assert g.outputs[0].token_ids == e[: len(g.outputs[0].token_ids)]
        assert len(g.outputs[0].token_ids) == len(e)
    assert "def" in got[0].prompt and got[0].outputs[0].text.strip()
