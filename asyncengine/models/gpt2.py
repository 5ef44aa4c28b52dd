"""GPT-2: learned positions, LayerNorm, fused c_attn, gelu_new MLP and an LM head tied to wte.

HF stores GPT-2's projections as Conv1D, whose weight is [in, out]; they are transposed while loading.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.layers.activation import get_act_fn
from asyncengine.layers.attention import Attention, SampledRows, get_attention_metadata
from asyncengine.layers.embedding import VocabParallelEmbedding
from asyncengine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from asyncengine.layers.norm import LayerNorm
from asyncengine.layers.parallel import IntermediateTensors, ParallelContext
from asyncengine.models.base import CausalLM

_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, layer_idx: int) -> None:
        super().__init__()
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.head_dim = hidden // heads
        scale = self.head_dim**-0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)  # HF folds this into the same softmax scale
        self.c_attn = QKVParallelLinear(hidden, self.head_dim, heads, heads, parallel, bias=True)
        self.c_proj = RowParallelLinear(hidden, hidden, parallel, bias=True)
        self.attn = Attention(self.c_attn.num_heads, self.head_dim, self.c_attn.num_kv_heads, scale)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        rows: SampledRows | None = None,  # the last layer's sampled rows: only they attend
    ) -> torch.Tensor:  # [T, hidden], or [len(rows), hidden]
        q, k, v = self.c_attn.split_qkv(self.c_attn(hidden))
        out = self.attn(q, k, v, rows=rows)
        return self.c_proj(out) if out.shape[0] else hidden.new_empty((0, hidden.shape[1]))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext) -> None:
        super().__init__()
        inner = getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, inner, parallel, bias=True)
        self.act = get_act_fn(cfg.activation_function)
        self.c_proj = RowParallelLinear(inner, cfg.hidden_size, parallel, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, layer_idx: int) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = LayerNorm(cfg.hidden_size, eps=eps)
        self.attn = GPT2Attention(cfg, parallel, layer_idx)
        self.ln_2 = LayerNorm(cfg.hidden_size, eps=eps)
        self.mlp = GPT2MLP(cfg, parallel)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden], the previous block's output (not yet added to the residual)
        residual: torch.Tensor,  # [T, hidden]
        rows: SampledRows | None = None,  # the model's last layer: carry on with these rows only
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # (h, r) -> ln(h + r), h + r: the residual add is deferred into the next LayerNorm
        hidden, residual = self.ln_1.fused_add(hidden, residual)
        hidden = self.attn(hidden, rows)
        if rows is not None:
            residual = residual[rows.indices]
            if not len(rows):
                return hidden, residual
        hidden, residual = self.ln_2.fused_add(hidden, residual)
        return self.mlp(hidden), residual


class GPT2Model(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext) -> None:
        super().__init__()
        self.wte: VocabParallelEmbedding | None = None
        self.wpe: nn.Embedding | None = None
        if parallel.is_first_stage:
            self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
            self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)  # small: replicated
        self.h = nn.ModuleDict(
            {
                str(i): GPT2Block(cfg, parallel, i)
                for i in range(cfg.num_hidden_layers)
                if parallel.owns_layer(i)
            }
        )
        self.ln_f = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon) if parallel.is_last_stage else None

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        intermediate: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.wte is not None and self.wpe is not None:
            assert input_ids is not None, "the first stage needs input_ids"
            # the first block's ln_1 adds them: wte + wpe as torch rounds it
            hidden, residual = self.wpe(positions), self.wte(input_ids)  # [T, hidden] each
        else:
            assert intermediate is not None, "a later stage needs the previous stage's tensors"
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        # on the last stage, the last block carries on with the sampled rows only (SampledRows); every
        # stage owns at least one layer (config.layer_range)
        rows = get_attention_metadata().sampled if self.ln_f is not None else None
        blocks = list(self.h.values())
        for i, block in enumerate(blocks):
            hidden, residual = block(hidden, residual, rows if i == len(blocks) - 1 else None)
        if rows is not None and not len(rows):
            return hidden
        if self.ln_f is None:
            return {"hidden_states": hidden, "residual": residual}
        return self.ln_f.fused_add(hidden, residual)[0]


class GPT2LMHeadModel(CausalLM):
    intermediate_names = ("hidden_states", "residual")  # the residual add is deferred past the stage boundary
    cuts_to_sampled_rows = True
    decoder_name = "transformer"
    layers_name = "h"
    embedding_name = "wte"
    tie_word_embeddings_default = True  # GPT2Config's default
    transformer: GPT2Model

    def __init__(self, hf_config: Any, parallel: ParallelContext) -> None:
        if getattr(hf_config, "add_cross_attention", False):
            raise ModelLoadError("GPT-2 with add_cross_attention=True (an encoder-decoder) is not supported")
        # NOTE: reorder_and_upcast_attn only changes the precision of HF's eager path (the sdpa default
        # ignores it), so it is accepted as is.
        super().__init__(hf_config, parallel)

    def make_decoder(self, hf_config: Any, parallel: ParallelContext) -> GPT2Model:
        return GPT2Model(hf_config, parallel)

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # the original OpenAI checkpoints have no prefix
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers of old checkpoints
            return None
        if name.endswith(_CONV1D):
            tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
        return name, tensor
