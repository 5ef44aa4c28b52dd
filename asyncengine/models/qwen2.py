"""Qwen2: Llama with a bias on the q/k/v projections (none on o_proj or the MLP).

Qwen2's optional sliding window applies to its "sliding_attention" layers (llama.sliding_window_of).
"""

from __future__ import annotations

from typing import Any

from asyncengine.models.llama import LlamaForCausalLM, LlamaOptions


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def options(cls, cfg: Any) -> LlamaOptions:
        return LlamaOptions(qkv_bias=True)
