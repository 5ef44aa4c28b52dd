"""Prompt token ids from a request's text or chat messages, bounded as the engine bounds its prompts.

Tokenizing a long prompt, and rendering a chat template over long messages, take a while: callers run
these in a thread, so other streams go on.
"""

from __future__ import annotations

import json
from typing import Any

from asyncengine.engine import AsyncEngine
from asyncengine.entrypoints.api_errors import ApiError
from asyncengine.entrypoints.chat_protocol import ChatTemplateFields, template_chars


def require_tokenizer(engine: AsyncEngine) -> Any:
    if engine.tokenizer is None:
        raise ApiError("this model has no tokenizer")
    return engine.tokenizer


def encode_prompt(engine: AsyncEngine, prompt: str, add_special_tokens: bool) -> list[int]:
    """A prompt's token ids (slow on long prompts: call it in a thread), bounded as the engine's are."""
    tok = require_tokenizer(engine)
    if len(prompt) > engine.max_prompt_chars:
        raise ApiError(
            f"the prompt has {len(prompt)} characters, more than max_model_len "
            f"({engine.max_model_len}) tokens can hold",
            param="prompt",
        )
    try:
        return list(tok.encode(prompt, add_special_tokens=add_special_tokens))
    except TypeError:  # the Rust tokenizer refuses what UTF-8 cannot hold: lone surrogates ("\ud800")
        raise ApiError("the prompt is not valid Unicode (a lone surrogate?)", param="prompt") from None


def render_chat(engine: AsyncEngine, req: ChatTemplateFields) -> list[int]:
    """The prompt token ids from the tokenizer's chat template (slow on long messages: call it in a
    thread)."""
    tok = engine.tokenizer
    if tok is None:
        raise ApiError(
            "this model has no tokenizer, so chat is unavailable: use /v1/completions with token ids"
        )
    if not getattr(tok, "chat_template", None):
        raise ApiError("this model's tokenizer has no chat template: use /v1/completions")
    messages = [m.as_template_input() for m in req.messages]
    kwargs = req.template_kwargs()
    if req.continue_final_message:  # only then: a template call of older transformers knows no such argument
        kwargs["continue_final_message"] = True
    tools = req.template_tools()
    if tools is not None:  # only then, too: a template without tools renders exactly as before
        kwargs["tools"] = tools
    chars = template_chars(messages) + len(json.dumps(kwargs, default=str))
    if chars > engine.max_prompt_chars:
        raise ApiError(
            f"the messages have {chars} characters, more than max_model_len "
            f"({engine.max_model_len}) tokens can hold",
            param="messages",
        )
    try:
        text = tok.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tokenize=False, **kwargs
        )
    except Exception as e:  # jinja raises anything (templates call raise_exception on bad roles)
        raise ApiError(f"cannot apply the chat template: {e}", param="messages") from None
    # NOTE: the template already wrote any BOS; encoding with special tokens (by default) would add another
    try:
        return list(tok.encode(text, add_special_tokens=req.add_special_tokens))
    except TypeError:  # lone surrogates
        raise ApiError("the messages are not valid Unicode (a lone surrogate?)", param="messages") from None
