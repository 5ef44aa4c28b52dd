"""Random-initialised tiny HF models, built with from_config + save_pretrained (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")


def hf_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    hidden = overrides.pop("hidden_size", 64)
    layers = overrides.pop("num_hidden_layers", 2)
    heads = overrides.pop("num_attention_heads", 4)
    kv_heads = overrides.pop("num_key_value_heads", 2)
    vocab = overrides.pop("vocab_size", 512)
    max_pos = overrides.pop("max_position_embeddings", 1024)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            vocab_size=vocab,
            n_positions=max_pos,
            bos_token_id=1,
            eos_token_id=2,
            **overrides,
        )
        cfg.architectures = ["GPT2LMHeadModel"]
        return cfg
    common = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        intermediate_size=overrides.pop("intermediate_size", 128),
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=overrides.pop("tie_word_embeddings", False),
    )
    common.update(overrides)
    cls, arch_name = {
        "llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
        "mistral": (transformers.MistralConfig, "MistralForCausalLM"),
        "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM"),
        "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM"),
    }[arch]
    cfg = cls(**common)
    cfg.architectures = [arch_name]
    return cfg


def build_tiny_model(
    arch: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """Saves a random model of `arch` to `path` and returns the directory."""
    cfg = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # random init leaves biases at zero; make them non-trivial so bias handling is actually checked
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf(path: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


TOKENIZER_CORPUS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Héllo wörld! ¿Qué tal? Ça va.",
    "日本語のテキスト、中文文本、한국어 텍스트 🙂🚀✨ emoji and multi-byte characters.",
    "import os\nimport sys\nprint('hello world')\nclass Foo:\n    pass\n",
] * 20


def build_tokenizer(path: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer trained on a tiny corpus, saved as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return path


def build_tiny_model_with_tokenizer(arch: str, path: Path, **overrides: Any) -> Path:
    build_tiny_model(arch, path, vocab_size=512, **overrides)
    build_tokenizer(path)
    return path


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, EOS ignored."""
    hf = load_hf(model_dir)
    hf.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos=True
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
            )
            out.append(ids[0, len(p) :].tolist())
    return out
