"""The bundled default model (asyncengine/assets/default-model): present, loadable, and as good as reported.

The engine-vs-HF greedy comparison lives with the engine tests; here only HF transformers is used.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO_ROOT / "asyncengine" / "assets" / "default-model"
TRAIN_SCRIPT = REPO_ROOT / "tools" / "train_default_model.py"
MAX_BYTES = 25 * 1024 * 1024
# Used instead of the logged threshold when this interpreter's stdlib holds out other files than the
# training run's did (another Python version): still far below an untrained model's ~8.3 nats.
FOREIGN_STDLIB_MARGIN = 0.5


def _load_train_module() -> ModuleType:
    """tools/ is not a package; load the script by path (importing it has no side effects)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    name = "train_default_model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TRAIN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_mod() -> ModuleType:
    return _load_train_module()


@pytest.fixture(scope="module")
def training_log() -> dict:
    return json.loads((MODEL_DIR / "training_log.json").read_text())


@pytest.fixture(scope="module")
def hf_model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


def test_bundle_files_and_size() -> None:
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "loss_curve.png",
        "training_log.json",
    ):
        assert (MODEL_DIR / name).is_file(), f"missing {name}"
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= MAX_BYTES, f"bundle is {total / 2**20:.1f} MiB"
    tok_cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # exercises GQA


def test_tokenizer_loads_offline(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert tokenizer.bos_token_id == 0 and tokenizer.pad_token_id == 0
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    text = "def f(x):\n    return x  # naïve\n\n\tpass\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: lossless
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_config_matches_weights(
    hf_model: transformers.PreTrainedModel, tokenizer, training_log: dict
) -> None:
    n_params = sum(p.numel() for p in hf_model.parameters())
    assert n_params == training_log["n_params"]
    assert hf_model.config.vocab_size == len(tokenizer)
    assert all(p.dtype == torch.float32 for p in hf_model.parameters())


def test_heldout_loss_below_reported(train_mod: ModuleType, hf_model, tokenizer, training_log: dict) -> None:
    """Recomputes the held-out loss on the same deterministic slice the training run logged."""
    files = train_mod.split_corpus(train_mod.corpus_files())[1]
    windows = train_mod.heldout_eval_windows(tokenizer, heldout_files=files)
    assert windows.shape == (training_log["test_slice"]["n_windows"], training_log["test_slice"]["seq_len"])
    loss = train_mod.heldout_loss(hf_model, windows)
    final = training_log["final"]
    if files == training_log["corpus"]["heldout_file_list"]:
        threshold = final["test_threshold"]
    else:
        threshold = final["heldout_loss_test_slice"] + FOREIGN_STDLIB_MARGIN
    assert loss < threshold, (
        f"held-out loss {loss:.4f} >= {threshold:.4f} (logged {final['heldout_loss_test_slice']:.4f})"
    )


def test_greedy_completion_looks_like_python(hf_model, tokenizer) -> None:
    ids = tokenizer("def fibonacci(n):", return_tensors="pt")
    out = hf_model.generate(**ids, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :])
    # a function body: a new line, indented
    assert text.startswith("\n    ") or "\n    " in text[:16], repr(text)


@pytest.mark.slow
def test_quick_training_run(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), "--quick", "--threads", "1", "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert elapsed < 60, f"--quick took {elapsed:.0f}s"
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["quick"] is True and log["eval"], log.keys()
    assert log["final"]["heldout_loss"] < log["eval"][0]["heldout_loss"]  # it learned something
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "loss_curve.png",
        "README.md",
    ):
        assert (tmp_path / name).is_file(), name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.vocab_size == len(tok)
