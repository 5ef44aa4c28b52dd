"""Qwen3: Llama plus an RMSNorm over each query and key head (q_norm / k_norm) before the rotary embedding."""

from __future__ import annotations

from typing import Any

from asyncengine.models.llama import LlamaForCausalLM, LlamaOptions


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def options(cls, cfg: Any) -> LlamaOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return LlamaOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
