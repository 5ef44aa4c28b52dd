"""Llama and the families shaped like it (Mistral here; Qwen2 and Qwen3 subclass it with their options).

Module names mirror HF's (`model.layers.3.self_attn...`) so checkpoint names map with a short table; the
only renames are the fused projections: q/k/v -> qkv_proj and gate/up -> gate_up_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncengine.cpu.amx import AmxWeight
from asyncengine.cpu.quant_gemm import QuantWeight
from asyncengine.layers.activation import ActAndMul
from asyncengine.layers.attention import Attention, SampledRows, get_attention_metadata
from asyncengine.layers.embedding import VocabParallelEmbedding
from asyncengine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from asyncengine.layers.norm import RMSNorm
from asyncengine.layers.parallel import IntermediateTensors, ParallelContext
from asyncengine.layers.rotary import RotaryEmbedding, max_rope_positions
from asyncengine.models.base import CausalLM


@dataclass(frozen=True)
class LlamaOptions:
    """Where the Llama-shaped families differ."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotary embedding


def sliding_window_of(hf_config: Any, layer: int) -> int | None:
    """The layer's attention window, as HF applies it: Mistral's `sliding_window` on every layer;
    with `layer_types` (Qwen2/3, where use_sliding_window=False leaves sliding_window None) only on
    the "sliding_attention" layers.

    NOTE: a Llama config.json may carry `sliding_window` too. HF's Llama mask ignores it, but
    `generate` builds its cache from the config and keeps only the window's keys, so HF's decode steps
    are windowed while its prefill is not. Applying the window throughout matches `generate` whenever
    the prompt fits in the window; a longer prompt's prefill differs (HF's own forward and generate
    disagree there)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer] != "sliding_attention":
        return None
    return int(window)


def head_dim_of(hf_config: Any) -> int:
    """Explicit `head_dim` when the config has one (Qwen3, Mistral-Nemo), else hidden / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, opts: LlamaOptions, layer: int) -> None:
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        total_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, total_kv, parallel, bias=opts.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim, cfg.hidden_size, parallel, bias=opts.o_bias
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if opts.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.head_dim,
            self.qkv_proj.num_kv_heads,
            self.head_dim**-0.5,
            sliding_window_of(cfg, layer),
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, rotary_dim / 2]
        sin: torch.Tensor,
        rows: SampledRows | None = None,  # the last layer's sampled rows: only they attend
    ) -> torch.Tensor:  # [T, hidden], or [len(rows), hidden]
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))  # [T, H * D], [T, Hkv * D], [T, Hkv * D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.per_head(q, self.head_dim), self.k_norm.per_head(k, self.head_dim)
        out = self.attn(q, k, v, rope=(cos, sin), rows=rows)  # rotated there, with the cache write
        return self.o_proj(out) if out.shape[0] else hidden.new_empty((0, hidden.shape[1]))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, opts: LlamaOptions) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter, inter], parallel, bias=opts.mlp_bias
        )
        self.act_fn = ActAndMul(cfg.hidden_act)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, parallel, bias=opts.mlp_bias)

    def prepack(self) -> bool:
        """On an AMX or AVX512-BF16 CPU (bfloat16) or an AVX-512 one (float32), packs the [gate | up] weight
        so that its GEMM writes silu(gate) * up directly (cpu_gemm.prepack_gated): one op less per layer and
        half the GEMM's output written."""
        return (
            self.act_fn.is_silu and self.gate_up_proj.packed is None and self.gate_up_proj.prepack(gated=True)
        )

    @property
    def fused_act(self) -> bool:
        """gate_up_proj's GEMM applies SiLU-and-mul itself."""
        packed = self.gate_up_proj.packed
        return isinstance(packed, AmxWeight | QuantWeight) and packed.gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.fused_act:
            return self.down_proj(self.gate_up_proj(x))  # [T, inter] already act(gate) * up
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, opts: LlamaOptions, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, parallel, opts, layer)
        self.mlp = LlamaMLP(cfg, parallel, opts)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden], the previous block's output (not yet added to the residual)
        residual: torch.Tensor | None,  # [T, hidden]; None before the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: SampledRows | None = None,  # the model's last layer: carry on with these rows only
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the residual add is deferred into the next norm: (h, r) -> norm(h + r), h + r
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.fused_add(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, rows)
        if rows is not None:
            residual = residual[rows.indices]
            if not len(rows):
                return hidden, residual
        hidden, residual = self.post_attention_layernorm.fused_add(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage: embedding on the first, final norm on the last."""

    def __init__(self, cfg: Any, parallel: ParallelContext, opts: LlamaOptions) -> None:
        super().__init__()
        self.parallel = parallel
        self.embed_tokens: VocabParallelEmbedding | None = None
        if parallel.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        # a ModuleDict keyed by the global layer index keeps HF's names (model.layers.7...) on every stage
        self.layers = nn.ModuleDict(
            {
                str(i): LlamaDecoderLayer(cfg, parallel, opts, i)
                for i in range(cfg.num_hidden_layers)
                if parallel.owns_layer(i)
            }
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if parallel.is_last_stage else None
        self.rotary_emb = RotaryEmbedding(cfg, head_dim_of(cfg), max_rope_positions(cfg))

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        intermediate: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        residual: torch.Tensor | None
        if self.embed_tokens is not None:
            assert input_ids is not None, "the first stage needs input_ids"
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:
            assert intermediate is not None, "a later stage needs the previous stage's tensors"
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        # on the last stage, the last layer carries on with the sampled rows only (SampledRows); every
        # stage owns at least one layer (config.layer_range)
        rows = get_attention_metadata().sampled if self.norm is not None else None
        layers = list(self.layers.values())
        for i, layer in enumerate(layers):
            hidden, residual = layer(hidden, residual, cos, sin, rows if i == len(layers) - 1 else None)
        if rows is not None and not len(rows):
            return hidden
        if self.norm is None:
            # hidden + residual is the true stream; a zero residual keeps the pair's meaning if no layer ran
            return {
                "hidden_states": hidden,
                "residual": residual if residual is not None else torch.zeros_like(hidden),
            }
        if residual is None:
            return self.norm(hidden)
        return self.norm.fused_add(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    intermediate_names = ("hidden_states", "residual")  # the residual add is deferred past the stage boundary
    cuts_to_sampled_rows = True
    stacked_params = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )
    model: LlamaModel

    @classmethod
    def options(cls, cfg: Any) -> LlamaOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return LlamaOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))

    def make_decoder(self, hf_config: Any, parallel: ParallelContext) -> LlamaModel:
        return LlamaModel(hf_config, parallel, self.options(hf_config))

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if "rotary_emb.inv_freq" in name:  # a buffer older checkpoints saved; recomputed here
            return None
        return name, tensor


class MistralForCausalLM(LlamaForCausalLM):
    """Llama without biases, and with a sliding window on every layer when the config sets one."""

    @classmethod
    def options(cls, cfg: Any) -> LlamaOptions:
        return LlamaOptions()
