"""Tokenizer loading; a model directory without tokenizer files works with token-id prompts.

The engine process reads the tokenizer while its workers import torch and load weights, so this is on
the cold-start path. transformers' AutoTokenizer imports torch and most of transformers (seconds);
`FastTokenizer` (fast_tokenizer.py) builds the very same `tokenizers.Tokenizer` from tokenizer.json with
the `tokenizers` library alone, for the directories where transformers (5.x) would do exactly that: a
generic tokenizer class (PreTrainedTokenizerFast / TokenizersBackend) for a model type AutoTokenizer
serves with it, and none of the options that make transformers rewrite the backend (see
`_fast_path_blocker`). Encoding, decoding and chat templates then follow transformers' TokenizersBackend
step by step; every other directory, and every method FastTokenizer does not implement, goes to
transformers (loaded then).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from asyncengine.errors import ConfigError
from asyncengine.fast_tokenizer import SPECIAL_TOKENS_ATTRIBUTES, FastTokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# model types whose generic tokenizer_class AutoTokenizer honours (qwen2 is on its list of hubs with a
# wrong class and gets Qwen2Tokenizer: a class of its own, so transformers loads it)
FAST_MODEL_TYPES = ("llama", "mistral", "qwen3", "gpt2")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers.utils.hub: it wins over tokenizer_config's
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def load_tokenizer(path: str) -> Any | None:
    """FastTokenizer where it is exact, else transformers' AutoTokenizer; None without tokenizer files."""
    if not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    fast = load_fast_tokenizer(path)
    return fast if fast is not None else load_hf_tokenizer(path)


def load_hf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types here; one clear error for the user
        raise ConfigError(f"cannot load the tokenizer in {path}: {e}") from e


def load_fast_tokenizer(path: str) -> FastTokenizer | None:
    """The directory's tokenizer without transformers, or None when transformers would build a
    different one (or the files are unreadable: transformers then gives the error)."""
    try:
        files = _read_files(Path(path))
        blocker = _fast_path_blocker(files)
        if blocker is None:
            return FastTokenizer(path, files)
    except Exception as e:  # noqa: BLE001 (anything unexpected: transformers decides, and reports)
        blocker = f"{type(e).__name__}: {e}"
    logger.info("tokenizer in %s loads through transformers: %s", path, blocker)
    return None


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _read_files(d: Path) -> dict[str, Any]:
    return {
        "dir": d,
        "tokenizer_json": d / "tokenizer.json",
        "tokenizer_config": _read_json(d / "tokenizer_config.json"),
        "config": _read_json(d / "config.json"),
        "chat_template_file": d / CHAT_TEMPLATE_FILE,
    }


def _transformers_major() -> int | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return None


def _fast_path_blocker(files: dict[str, Any]) -> str | None:
    """Why transformers would not simply load tokenizer.json as TokenizersBackend does; None if it would."""
    d: Path = files["dir"]
    tc, config = files["tokenizer_config"], files["config"]
    major = _transformers_major()
    if major is not None and major != 5:
        return f"transformers {major}.x (FastTokenizer follows 5.x)"
    if not files["tokenizer_json"].exists():
        return "no tokenizer.json"
    if not isinstance(tc, dict):
        return "no tokenizer_config.json"
    if tc.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES:
        return f"tokenizer_class {tc.get('tokenizer_class')!r}"
    for key in ("auto_map", "fast_tokenizer_files"):
        if key in tc:
            return f"tokenizer_config.json has {key}"
    if not isinstance(config, dict) or config.get("model_type") not in FAST_MODEL_TYPES:
        return f"model_type {config.get('model_type') if isinstance(config, dict) else None!r}"
    if tc.get("split_special_tokens") or tc.get("fix_mistral_regex"):
        return "split_special_tokens / fix_mistral_regex"
    if (d / CHAT_TEMPLATE_DIR).exists():
        return f"{CHAT_TEMPLATE_DIR}/ (named chat templates)"
    if tc.get("chat_template") is not None and not isinstance(tc["chat_template"], str):
        return "named chat templates"
    if "added_tokens_decoder" not in tc and any(
        (d / f).exists() for f in ("special_tokens_map.json", "added_tokens.json")
    ):
        return "legacy special_tokens_map.json / added_tokens.json"
    for key, value in tc.items():
        if key in SPECIAL_TOKENS_ATTRIBUTES:
            if value is not None and not isinstance(value, str) and not _is_added_token_dict(value):
                return f"{key} is {value!r}"
        elif key.endswith("_token") and isinstance(value, (str, dict)):
            return f"model-specific special token {key}"
    extra = tc.get("extra_special_tokens") or tc.get("additional_special_tokens")
    if extra is not None and not (
        isinstance(extra, list) and all(isinstance(t, str) or _is_added_token_dict(t) for t in extra)
    ):
        return "extra_special_tokens is not a list of tokens"
    raw = json.loads(files["tokenizer_json"].read_text(encoding="utf-8"))
    if raw.get("truncation") is not None or raw.get("padding") is not None:
        return "tokenizer.json sets truncation or padding"
    if raw.get("post_processor") is None:
        return "tokenizer.json has no post_processor (transformers writes one)"
    return None


def _is_added_token_dict(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.get("__type") == "AddedToken"
        and isinstance(value.get("content"), str)
    )


def eos_token_ids(model_dir: str, tokenizer: Any | None) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (any may be a list)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(model_dir) / name
        if f.exists():
            value = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def max_token_chars(tokenizer: Any | None) -> int:
    """An upper bound on the characters of text that one token covers.

    A vocabulary string has at least as many characters as the text it decodes to (byte-level BPE spells
    each byte with one character; SentencePiece spells a space with one "▁", a byte as "<0x0A>"); the
    factor 2 leaves room for normalizers that drop characters. 1 without a tokenizer (no text prompts).
    """
    if tokenizer is None:
        return 1
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 2 * max(longest, 8)
