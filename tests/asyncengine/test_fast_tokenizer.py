"""FastTokenizer (asyncengine/fast_tokenizer.py) against transformers' AutoTokenizer on the same directory:
the same backend tokenizer, encodings, decodings, special tokens and chat templates; and transformers
wherever it would build something else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers
from tiny_models import build_tokenizer

from asyncengine.config import default_model_path
from asyncengine.fast_tokenizer import FastTokenizer
from asyncengine.tokenizer import load_fast_tokenizer, load_tokenizer

TEXTS = [
    "Hello world!",
    "  leading spaces and trailing  ",
    "tabs\tand\nnewlines\r\n",
    "Héllo wörld ¿Qué tal? 🙂🚀",
    "日本語のテキスト",
    "<s>inline special</s> tokens <unk>",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    " ",
    "don't stop , ok . really ?",
    "def f(x):\n    return x  # comment",
]
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "Hi there, 🙂?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "more"},
]
# exercises what transformers' Jinja environment adds: loop controls, {% generation %}, its tojson,
# raise_exception, special tokens as variables, trim_blocks / lstrip_blocks
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}\n"
    "  {% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role') }}{% endif %}\n"
    "  {% if m['role'] == 'system' %}{% continue %}{% endif %}\n"
    "  {% if m['role'] == 'assistant' %}"
    "{% generation %}A: {{ m['content'] }}{{ eos_token }}{% endgeneration %}\n"
    "  {% else %}U: {{ m['content'] | tojson }}\n{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}{{ extra_var | default('') }}"
)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok-base"))


def variant(
    base: Path,
    dest: Path,
    model_type: str = "llama",
    config: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    files: dict[str, str] | None = None,
) -> Path:
    """A copy of `base`'s tokenizer files with config.json's model_type, tokenizer_config.json edits
    (None deletes a key), files removed and files added."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / f).exists() and f not in drop:
            shutil.copy(base / f, dest / f)
    (dest / "config.json").write_text(json.dumps({"model_type": model_type}))
    tc = json.loads((dest / "tokenizer_config.json").read_text())
    for k, v in (config or {}).items():
        if v is None:
            tc.pop(k, None)
        else:
            tc[k] = v
    (dest / "tokenizer_config.json").write_text(json.dumps(tc))
    for name, text in (files or {}).items():
        (dest / name).write_text(text)
    return dest


FAST_CASES: dict[str, dict[str, Any]] = {
    "llama": {},
    "gpt2": {"model_type": "gpt2"},
    "mistral": {"model_type": "mistral"},
    "qwen3": {"model_type": "qwen3"},
    "template in config, special token added": {
        "drop": ("chat_template.jinja",),
        "config": {
            "chat_template": TEMPLATE,
            "additional_special_tokens": ["<|tool|>", "<s>"],
            "pad_token": "<pad>",
        },
    },
    "jinja file wins over config": {
        "config": {"chat_template": "ignored"},
        "files": {"chat_template.jinja": TEMPLATE},
    },
    "added_tokens_decoder flags": {
        "config": {
            "added_tokens_decoder": {
                "0": {
                    "content": "<unk>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                },
                "1": {
                    "content": "<s>",
                    "lstrip": True,
                    "normalized": False,
                    "rstrip": True,
                    "single_word": False,
                    "special": False,
                },
                "2": {
                    "content": "</s>",
                    "lstrip": False,
                    "normalized": True,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                },
            },
            "eos_token": {
                "__type": "AddedToken",
                "content": "</s>",
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            },
        }
    },
    "clean-up spaces (skipped for BPE)": {"config": {"clean_up_tokenization_spaces": True}},
    "clean-up spaces forced": {
        "config": {
            "clean_up_tokenization_spaces": True,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True,
        }
    },
}


def assert_same(fast: FastTokenizer, hf: Any) -> None:
    assert fast.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert fast.encode(text, add_special_tokens=special) == ids, text
        ids = hf.encode(text)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (
                text
            )
            assert fast.convert_ids_to_tokens(ids, skip_special_tokens=skip) == hf.convert_ids_to_tokens(
                ids, skip_special_tokens=skip
            )
            assert fast.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            ) == hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    every_id = list(range(len(hf)))
    assert [fast.decode([i]) for i in every_id] == [hf.decode([i]) for i in every_id]
    assert fast.decode(7) == hf.decode(7)
    assert fast.decode([[5, 6], [7]]) == hf.decode([[5, 6], [7]])
    assert fast.get_vocab() == hf.get_vocab() and fast.get_added_vocab() == hf.get_added_vocab()
    assert (len(fast), fast.vocab_size) == (len(hf), hf.vocab_size)
    assert fast.special_tokens_map == hf.special_tokens_map
    assert fast.all_special_tokens == hf.all_special_tokens and fast.all_special_ids == hf.all_special_ids
    for name in ("bos", "eos", "unk", "pad", "sep", "cls", "mask"):
        assert getattr(fast, f"{name}_token") == getattr(hf, f"{name}_token"), name
        assert getattr(fast, f"{name}_token_id") == getattr(hf, f"{name}_token_id"), name
    assert fast.convert_tokens_to_ids(["<s>", "never-a-token"]) == hf.convert_tokens_to_ids(
        ["<s>", "never-a-token"]
    )
    assert fast.chat_template == hf.chat_template
    if hf.chat_template is not None:
        for gen in (True, False):
            for msgs in (MESSAGES, MESSAGES[1:2]):
                text = hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
                assert fast.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False) == text
                ids = hf.apply_chat_template(
                    msgs, add_generation_prompt=gen, tokenize=True, return_dict=False
                )
                assert (
                    fast.apply_chat_template(
                        msgs, add_generation_prompt=gen, tokenize=True, return_dict=False
                    )
                    == ids
                )
        kwargs = {"add_generation_prompt": True, "tokenize": False, "extra_var": "<x>"}
        assert fast.apply_chat_template(MESSAGES, **kwargs) == hf.apply_chat_template(MESSAGES, **kwargs)


@pytest.mark.parametrize("case", list(FAST_CASES))
def test_fast_tokenizer_matches_transformers(case: str, tiny_tokenizer: Path, tmp_path: Path) -> None:
    path = variant(tiny_tokenizer, tmp_path / "tok", **FAST_CASES[case])
    fast = load_tokenizer(str(path))
    assert isinstance(fast, FastTokenizer)
    hf = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert type(hf).__name__ == "TokenizersBackend"
    assert_same(fast, hf)


def test_default_model_tokenizer_is_fast_and_matches(tmp_path: Path) -> None:
    fast = load_tokenizer(default_model_path())
    assert isinstance(fast, FastTokenizer)  # the cold start counts on it: a transformers bump must keep it
    assert_same(fast, transformers.AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True))


def test_bad_role_raises_template_error(tiny_tokenizer: Path, tmp_path: Path) -> None:
    import jinja2

    path = variant(tiny_tokenizer, tmp_path / "tok", files={"chat_template.jinja": TEMPLATE})
    fast = load_fast_tokenizer(str(path))
    assert fast is not None
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        fast.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


FALLBACK_CASES: dict[str, dict[str, Any]] = {
    "qwen2 gets Qwen2Tokenizer": {"model_type": "qwen2"},
    "a tokenizer class of its own": {"config": {"tokenizer_class": "GPT2Tokenizer"}},
    "split_special_tokens": {"config": {"split_special_tokens": True}},
    "model-specific special token": {"config": {"image_token": "<s>"}},
    "legacy special_tokens_map.json": {"files": {"special_tokens_map.json": '{"eos_token": "</s>"}'}},
    "named chat templates": {"files": {"additional_chat_templates/tool_use.jinja": "x"}},
}


@pytest.mark.parametrize("case", list(FALLBACK_CASES))
def test_falls_back_to_transformers(case: str, tiny_tokenizer: Path, tmp_path: Path) -> None:
    spec = dict(FALLBACK_CASES[case])
    files = spec.pop("files", {})
    path = variant(tiny_tokenizer, tmp_path / "tok", **spec)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    assert load_fast_tokenizer(str(path)) is None
    tok = load_tokenizer(str(path))
    assert not isinstance(tok, FastTokenizer)
    assert tok.encode("Hello world!") == transformers.AutoTokenizer.from_pretrained(str(path)).encode(
        "Hello world!"
    )


def test_other_methods_come_from_transformers(tiny_tokenizer: Path, tmp_path: Path) -> None:
    path = variant(tiny_tokenizer, tmp_path / "tok")
    fast = load_fast_tokenizer(str(path))
    assert fast is not None and fast._hf is None
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    assert fast.tokenize("Hello world!") == hf.tokenize("Hello world!")  # not implemented: transformers'
    assert fast("Hello world!")["input_ids"] == hf("Hello world!")["input_ids"]
    assert fast.apply_chat_template(MESSAGES)["input_ids"] == hf.apply_chat_template(MESSAGES)["input_ids"]
    assert fast._hf is not None


def test_lone_surrogate_is_a_type_error(tiny_tokenizer: Path) -> None:
    fast = load_fast_tokenizer(str(variant(tiny_tokenizer, tiny_tokenizer.parent / "surrogate")))
    assert fast is not None
    with pytest.raises(TypeError):  # input_processor turns it into InvalidRequestError
        fast.encode("a\ud800b")
