"""Granite (IBM's ``GraniteForCausalLM``, GGUF ``granite``): Llama's layer with four multipliers, as
transformers' GraniteForCausalLM applies them (and Granite 4.0's hybrids reuse):
- the embeddings times embedding_multiplier;
- each attention and MLP output times residual_multiplier before it joins the residual stream;
- the attention softmax scaled by attention_multiplier itself (not 1 / sqrt(head_dim));
- the logits divided by logits_scaling (ModelConfig.logit_scale holds its reciprocal).
"""

from __future__ import annotations

import dataclasses

import torch

from tokenloom.attention.backend import StepAttention
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.models.config import ModelConfig
from tokenloom.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, attend: StepAttention, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaDecoderLayer.forward with each sublayer's fresh output scaled in place before it is
        added to the residual stream (the add deferred into the next norm, as there)."""
        if residual is None:
            residual, normed = x, self.input_layernorm.forward(x)
        else:
            normed, residual = self.input_layernorm.add_forward(x, residual)
        attn = self.self_attn.forward(normed, attend, layer).mul_(self.residual_multiplier)
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp.forward(normed).mul_(self.residual_multiplier), residual


class GraniteForCausalLM(LlamaForCausalLM):
    """Loads HF ``GraniteForCausalLM`` checkpoints and GGUF ``granite`` files (see the module doc)."""

    decoder_layer = GraniteDecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        assert cfg.attention_multiplier is not None  # Granite's configs give the softmax scale
        self.attention_shape = dataclasses.replace(self.attention_shape, scale=cfg.attention_multiplier)

    def embed_and_plan(self, input_ids, positions, meta, kv_cache: PagedKVCache) -> tuple[torch.Tensor, StepAttention]:
        """Embeddings (T, hidden) times embedding_multiplier, and the step's attention op."""
        h = self.model.embed_tokens(input_ids) * self.config.embedding_multiplier
        return h, self.plan(positions, meta, kv_cache, h.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.config.logit_scale
