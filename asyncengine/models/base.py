"""The shell every causal LM here shares: the decoder stack under HF's name, the LM head (tied to the
input embedding when the config says so), `compute_logits`, and `load_weights`, which keeps only this
pipeline stage's layers and fills fused parameters shard by shard.

A model subclasses CausalLM and keeps what differs: its decoder stack (`make_decoder`), where in it the
layers and the embedding sit (class attributes, HF's names, so checkpoint names need no table), its
stacked-params table, and whatever its checkpoints need renamed, skipped or transposed (`map_weight`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from asyncengine.layers.embedding import ParallelLMHead
from asyncengine.layers.linear import load_into
from asyncengine.layers.parallel import IntermediateTensors, ParallelContext


class CausalLM(nn.Module):
    """One pipeline stage's shard of a decoder-only LM: embedding on the first stage, LM head on the last."""

    # the tensors a stage hands the next one (IntermediateTensors keys), in the order they are sent
    intermediate_names: ClassVar[tuple[str, ...]] = ("hidden_states",)
    # (our fused param, HF's name, shard_id): a checkpoint tensor that fills one shard of a fused parameter
    stacked_params: ClassVar[tuple[tuple[str, str, Any], ...]] = ()
    # HF's attribute names: the decoder stack (also the prefix of its checkpoint names), the ModuleDict of
    # its layers keyed by global index, and its input embedding (None on stages after the first)
    decoder_name: ClassVar[str] = "model"
    layers_name: ClassVar[str] = "layers"
    embedding_name: ClassVar[str] = "embed_tokens"
    # HF's default for a config.json without tie_word_embeddings (it differs by family)
    tie_word_embeddings_default: ClassVar[bool] = False
    # whether the last stage's decoder cuts its last layer to the step's sampled rows where the forward
    # context names them (AttentionMetadata.sampled): its output is then [len(rows), hidden], not [T, hidden]
    cuts_to_sampled_rows: ClassVar[bool] = False

    def __init__(self, hf_config: Any, parallel: ParallelContext) -> None:
        super().__init__()
        self.config = hf_config
        self.parallel = parallel
        self.hidden_size: int = hf_config.hidden_size
        tied = getattr(hf_config, "tie_word_embeddings", self.tie_word_embeddings_default)
        self.tie_word_embeddings = bool(tied)
        decoder = self.make_decoder(hf_config, parallel)
        # registered before lm_head: a tied head's weight then keeps the embedding's name in named_parameters
        self.add_module(self.decoder_name, decoder)
        self.lm_head: ParallelLMHead | None = None
        if parallel.is_last_stage:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, parallel)
            embedding = getattr(decoder, self.embedding_name)
            if self.tie_word_embeddings and embedding is not None:
                self.lm_head.tie_to(embedding)
        self._embedding_weight = f"{self.decoder_name}.{self.embedding_name}.weight"
        self._layer = re.compile(rf"^{re.escape(self.decoder_name)}\.{re.escape(self.layers_name)}\.(\d+)\.")

    def make_decoder(self, hf_config: Any, parallel: ParallelContext) -> nn.Module:
        """This stage's decoder stack: forward(input_ids, positions, intermediate) -> the final norm's
        output on the last stage, else the IntermediateTensors named by `intermediate_names`."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T] int64; None on stages after the first
        positions: torch.Tensor,  # [T] int64
        intermediate: IntermediateTensors | None = None,  # the previous stage's output; None on the first
    ) -> torch.Tensor | IntermediateTensors:  # last stage: [T, hidden] after the final norm
        decoder: nn.Module = getattr(self, self.decoder_name)
        return decoder(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab], model dtype
        assert self.lm_head is not None, "compute_logits runs on the last pipeline stage only"
        return self.lm_head.compute_logits(hidden)

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """A checkpoint tensor as this model's parameters name and lay it out; None skips it."""
        return name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF checkpoint tensors into this shard; returns the names of the parameters it filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards: dict[str, set[Any]] = {}  # fused param -> shard ids seen; complete only when all arrived
        for hf_name, hf_tensor in weights:
            mapped = self.map_weight(hf_name, hf_tensor)
            if mapped is None:
                continue
            name, tensor = mapped
            match = self._layer.match(name)
            if match and not self.parallel.owns_layer(int(match.group(1))):
                continue  # another stage's layer
            if name == self._embedding_weight and self.tie_word_embeddings and "lm_head.weight" in params:
                # a last stage without the embedding still needs it as its LM head
                load_into(params["lm_head.weight"], name, tensor)
                loaded.add("lm_head.weight")
            target, shard_id = name, None
            for fused, hf, sid in self.stacked_params:
                if hf in name:
                    target, shard_id = name.replace(hf, fused), sid
                    break
            if target not in params:  # another stage's embedding / head, or a tensor we do not use
                continue
            load_into(params[target], name, tensor, shard_id)
            if shard_id is None:
                loaded.add(target)
            else:
                shards.setdefault(target, set()).add(shard_id)
        for target, seen in shards.items():
            needed = {sid for fused, _, sid in self.stacked_params if fused in target}
            if seen >= needed:
                loaded.add(target)
        return loaded
