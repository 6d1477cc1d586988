"""Granite (IBM's ``GraniteForCausalLM``, GGUF ``granite``; ``GraniteMoeForCausalLM`` and
``GraniteMoeSharedForCausalLM``, GGUF ``granitemoe``): Llama's layer with four multipliers, as
transformers' Granite models apply them (and Granite 4.0's hybrids reuse):
- the embeddings times embedding_multiplier;
- each attention and MLP output times residual_multiplier before it joins the residual stream;
- the attention softmax scaled by attention_multiplier itself (not 1 / sqrt(head_dim));
- the logits divided by logits_scaling (ModelConfig.logit_scale holds its reciprocal).

The MoE members mix every layer: a router (``router.layer``) whose top-k logits are softmaxed
(models/moe.py route's renormalized top-k), experts stored stacked as JetMoE's ``input_linear``
(experts, gate rows then up rows, hidden) and ``output_linear`` (experts, hidden, intermediate), and
for the shared variant an ungated ``shared_mlp`` beside them (models/moe.py SparseMoeBlock), the
sum scaled by residual_multiplier.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tokenloom.attention.backend import StepAttention
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.models.config import ModelConfig
from tokenloom.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenloom.models.moe import MoeForCausalLM

# model.layers.N.{block_sparse_moe.input_linear, block_sparse_moe.output_linear, block_sparse_moe.router.layer,
# shared_mlp.input_linear, shared_mlp.output_linear}.weight
_JETMOE = re.compile(
    r"(model\.layers\.\d+)\.(block_sparse_moe|shared_mlp)\.(input_linear|output_linear|router\.layer)\.weight"
)


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
        attn = self.mix(normed, attend, layer).mul_(self.residual_multiplier)
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


class GraniteMoeForCausalLM(GraniteForCausalLM, MoeForCausalLM):
    """Granite's multipliers around a mixture in every layer (see the module doc)."""

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """JetMoE's stacked experts and fused gate/up split into Llama's names: per expert gate_proj,
        up_proj (the first and second halves of input_linear's rows) and down_proj; the router as the
        block's gate; the shared MLP as the shared expert."""
        for name, tensor in tensors:
            m = _JETMOE.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            layer, block, kind = m.groups()
            if kind == "router.layer":
                yield f"{layer}.mlp.gate.weight", tensor
            elif block == "shared_mlp":
                yield from _gate_up_down(f"{layer}.mlp.shared_expert", kind, tensor)
            else:
                for e, t in enumerate(tensor):
                    yield from _gate_up_down(f"{layer}.mlp.experts.{e}", kind, t)


def _gate_up_down(prefix: str, kind: str, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A JetMoE MLP's input_linear (gate rows, then up rows) or output_linear under Llama's names."""
    if kind == "output_linear":
        yield f"{prefix}.down_proj.weight", w
        return
    half = w.shape[0] // 2
    yield f"{prefix}.gate_proj.weight", w[:half]
    yield f"{prefix}.up_proj.weight", w[half:]
