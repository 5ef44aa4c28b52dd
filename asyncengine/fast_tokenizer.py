"""FastTokenizer: transformers' TokenizersBackend (5.x) on the `tokenizers` library alone.

asyncengine.tokenizer builds one where transformers would load tokenizer.json exactly as TokenizersBackend
does (see its `_fast_path_blocker`), so the engine process reads its tokenizer without importing torch or
transformers. Encoding, decoding and chat templates follow TokenizersBackend step by step; every method
FastTokenizer does not implement goes to transformers (loaded then).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES (transformers 5)
SPECIAL_TOKENS_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _added_token(value: Any) -> Any:
    """A tokenizer_config.json token (a string or an {"__type": "AddedToken", ...} dict) as transformers
    holds it."""
    from tokenizers import AddedToken

    if isinstance(value, dict):
        return AddedToken(**{k: v for k, v in value.items() if k != "__type"})
    return value


class FastTokenizer:
    """transformers' TokenizersBackend (5.x) for the generic case, on the `tokenizers` library alone.

    Implements what the engine and the server use (encode, decode, chat templates, vocabulary and
    special tokens) with the same results; any other attribute is taken from the transformers
    tokenizer of the same directory, loaded on first use.
    """

    is_fast = True

    def __init__(self, path: str, files: dict[str, Any]) -> None:
        from tokenizers import AddedToken, Tokenizer

        tc: dict[str, Any] = files["tokenizer_config"]
        self.name_or_path = path
        self._hf: Any = None
        self._hf_lock = threading.Lock()
        self._tokenizer = tok = Tokenizer.from_file(str(files["tokenizer_json"]))
        tok.no_truncation()  # transformers does the same when tokenizer.json sets none

        # added tokens: tokenizer_config's added_tokens_decoder, or else tokenizer.json's own
        if "added_tokens_decoder" in tc:
            decoder = {int(i): AddedToken(**t) for i, t in tc["added_tokens_decoder"].items()}
        else:
            raw = json.loads(files["tokenizer_json"].read_text(encoding="utf-8"))
            decoder = {
                t["id"]: AddedToken(**{k: v for k, v in t.items() if k != "id"}) for t in raw["added_tokens"]
            }
        by_content = {str(t): t for t in decoder.values()}
        self._special: dict[str, Any] = {}  # named special tokens, as strings or AddedTokens
        for key in SPECIAL_TOKENS_ATTRIBUTES:
            value = _added_token(tc.get(key))
            if value is not None:
                self._special[key] = by_content.get(str(value), value) if by_content else value
        extra = tc.get("extra_special_tokens") or tc.get("additional_special_tokens") or []
        self._extra_special = [_added_token(t) for t in extra]

        # TokenizersBackend.__init__: every added_tokens_decoder entry is (re-)added, then the special
        # tokens the vocabulary lacks; a string becomes a special AddedToken
        to_add = [t for _, t in sorted(decoder.items(), key=lambda item: item[0])]
        encoder = [t.content for _, t in sorted(tok.get_added_tokens_decoder().items())] + [
            str(t) for t in to_add
        ]
        for value in [*self._special.values(), *self._extra_special]:
            if str(value) not in encoder and value not in to_add:
                to_add.append(value)
        if to_add:
            named = [str(t) for t in self._special.values() if t]
            tokens = []
            for t in to_add:
                if isinstance(t, str):
                    t = AddedToken(t, special=True)
                elif not t.special and str(t) in named:
                    t.special = True
                tokens.append(t)
            tok.add_tokens(tokens)
        tok.encode_special_tokens = False  # split_special_tokens (a blocker when set)

        self.clean_up_tokenization_spaces = bool(tc.get("clean_up_tokenization_spaces", False))
        self._cleanup_bpe = bool(
            tc.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        )
        template_file: Path = files["chat_template_file"]
        self.chat_template: str | None = (
            template_file.read_text(encoding="utf-8") if template_file.exists() else tc.get("chat_template")
        )
        self.model_max_length = tc.get("model_max_length") or int(1e30)

    # -- special tokens ---------------------------------------------------------------------------
    def _special_token(self, key: str) -> str | None:
        value = self._special.get(key)
        return None if value is None else str(value)

    bos_token = property(lambda self: self._special_token("bos_token"))
    eos_token = property(lambda self: self._special_token("eos_token"))
    unk_token = property(lambda self: self._special_token("unk_token"))
    sep_token = property(lambda self: self._special_token("sep_token"))
    pad_token = property(lambda self: self._special_token("pad_token"))
    cls_token = property(lambda self: self._special_token("cls_token"))
    mask_token = property(lambda self: self._special_token("mask_token"))

    def _special_id(self, key: str) -> int | None:
        token = self._special_token(key)
        return None if token is None else self.convert_tokens_to_ids(token)

    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    sep_token_id = property(lambda self: self._special_id("sep_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    cls_token_id = property(lambda self: self._special_id("cls_token"))
    mask_token_id = property(lambda self: self._special_id("mask_token"))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {key: str(value) for key, value in self._special.items() if value is not None}

    @property
    def extra_special_tokens(self) -> list[str]:
        return [str(t) for t in self._extra_special]

    @property
    def all_special_tokens(self) -> list[str]:
        seen: dict[str, None] = {}
        for value in [*self._special.values(), *self._extra_special]:
            seen.setdefault(str(value))
        return list(seen)

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # -- vocabulary -------------------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        added = self._tokenizer.get_added_tokens_decoder()
        return {t.content: i for i, t in sorted(added.items(), key=lambda item: item[0])}

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            index = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # -- encode / decode --------------------------------------------------------------------------
    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """TypeError for what UTF-8 cannot hold (a lone surrogate), as transformers raises."""
        if not isinstance(text, str) or kwargs:  # pairs, batches, padding, tensors: transformers' own
            return self._transformers().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        token_ids: Any,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        if kwargs or not isinstance(token_ids, (int, list, tuple)):  # tensors, arrays, dicts
            return self._transformers().decode(
                token_ids,
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                **kwargs,
            )
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [
                self.decode(list(ids), skip_special_tokens, clean_up_tokenization_spaces) for ids in token_ids
            ]
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        clean = (
            self.clean_up_tokenization_spaces
            if clean_up_tokenization_spaces is None
            else clean_up_tokenization_spaces
        )
        # transformers skips the clean-up for BPE models (it would strip real spaces) unless told otherwise
        if clean and (type(self._tokenizer.model).__name__ != "BPE" or self._cleanup_bpe):
            text = clean_up_tokenization(text)
        return text

    def batch_decode(
        self,
        sequences: Sequence[Sequence[int]],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> list[str]:
        return [self.decode(list(s), skip_special_tokens, clean_up_tokenization_spaces) for s in sequences]

    # -- chat -------------------------------------------------------------------------------------
    def apply_chat_template(
        self, conversation: Any, add_generation_prompt: bool = False, tokenize: bool = True, **kwargs: Any
    ) -> Any:
        """Renders one conversation as transformers does (same Jinja environment, special tokens and
        arguments). tokenize=True returns the token ids when return_dict=False is given; otherwise
        (a BatchEncoding), and for documents, batches, named templates, continue_final_message or
        tools that are not all dicts (functions, which transformers converts to schemas), transformers'
        own method runs. Dict tools reach the template as given, as transformers passes them."""
        simple = (
            isinstance(conversation, (list, tuple))
            and conversation
            and all(isinstance(m, dict) for m in conversation)
            and (not tokenize or kwargs.get("return_dict") is False)
        )
        tools = kwargs.get("tools")
        dict_tools = isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)
        hf_args = (
            *(() if tools is None or dict_tools else ("tools",)),
            "documents",
            "chat_template",
            "continue_final_message",
            "padding",
            "truncation",
            "max_length",
            "return_tensors",
            "return_assistant_tokens_mask",
            "tokenizer_kwargs",
        )
        if (
            not simple
            or any(kwargs.get(a) not in (None, False) for a in hf_args)
            or self.chat_template is None
        ):
            return self._transformers().apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
            )
        template_kwargs = {k: v for k, v in kwargs.items() if k not in (*hf_args, "tools", "return_dict")}
        text = _compiled_template(self.chat_template).render(
            messages=list(conversation),
            tools=list(tools) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **template_kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- everything else --------------------------------------------------------------------------
    def _transformers(self) -> Any:
        # NOTE: imported here: asyncengine.tokenizer imports this module (it builds FastTokenizers)
        from asyncengine.tokenizer import load_hf_tokenizer

        with self._hf_lock:
            if self._hf is None:
                logger.info(
                    "loading transformers' tokenizer for %s (a method FastTokenizer leaves to it)",
                    self.name_or_path,
                )
                self._hf = load_hf_tokenizer(self.name_or_path)
            return self._hf

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._transformers()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only for names not defined above
        if name.startswith("__") or name in ("_hf", "_hf_lock", "_tokenizer", "_special", "_extra_special"):
            raise AttributeError(name)
        return getattr(self._transformers(), name)

    def __repr__(self) -> str:
        return f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"


def clean_up_tokenization(text: str) -> str:
    """PreTrainedTokenizerBase.clean_up_tokenization."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


@lru_cache
def _compiled_template(template: str) -> Any:
    """transformers.utils.chat_template_utils._cached_compile_jinja_template: a sandboxed environment
    with trim_blocks, lstrip_blocks, loop controls, the {% generation %} tag (rendered as its body),
    its tojson filter and the raise_exception / strftime_now globals."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # transformers' AssistantTracker; its tracking is for assistant token masks only, not used here
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _body(self, context: Any, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
