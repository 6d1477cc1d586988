"""Gemma 3 (text) and Gemma 2: a Llama-shaped decoder with Gemma's own arithmetic.

What differs from models/llama.py, each as transformers' Gemma3ForCausalLM does it:
- embeddings scaled by sqrt(hidden) (a float32 constant in the weights' dtype);
- RMSNorm multiplies by (1 + w): the checkpoint's w is stored here as 1 + w at load
  (computed in float32, as HF computes it on every call), so the norms are Llama's
  own fused ops, the same bits;
- four norms a layer: after attention and after the MLP the output is normed before
  it joins the residual stream (post_attention_layernorm, post_feedforward_layernorm);
- per-head q/k norm, attention scaled by query_pre_attn_scalar ** -0.5;
- sliding-window and full-attention layers interleaved (layer_types), each kind with
  its own rotary base (rope_local_base_freq for sliding layers);
- a GELU-tanh gated MLP, tied output projection, optional final logit soft-capping.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.attention.backend import StepAttention
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.layers.mlp import GatedMLP
from tokenloom.layers.norms import RMSNorm
from tokenloom.models.config import ModelConfig
from tokenloom.models.llama import LlamaAttention, LlamaForCausalLM


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, attend: StepAttention, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's normed MLP output (the scaled embeddings for layer 0, with
        residual None) -> (this layer's normed MLP output, the residual stream before it is
        added); each residual add runs inside the next norm (the same sums, one op)."""
        if residual is None:
            residual, normed = x, self.input_layernorm.forward(x)
        else:
            normed, residual = self.input_layernorm.add_forward(x, residual)
        attn = self.post_attention_layernorm.forward(self.self_attn.forward(normed, attend, layer))
        normed, residual = self.pre_feedforward_layernorm.add_forward(attn, residual)
        return self.post_feedforward_layernorm.forward(self.mlp.forward(normed)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loads HF ``Gemma3ForCausalLM`` checkpoints and GGUF ``gemma3`` files (see the module doc)."""

    decoder_layer = Gemma3DecoderLayer

    def transform_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Gemma's norms scale by (1 + w): keep 1 + w, computed in float32 as HF does per call."""
        if name.endswith("norm.weight"):
            return 1.0 + tensor.float()
        return tensor

    def embed_and_plan(self, input_ids, positions, meta, kv_cache: PagedKVCache) -> tuple[torch.Tensor, StepAttention]:
        """Scaled embeddings (T, hidden); sliding layers attend with the local rope base (Gemma 3:
        LlamaForCausalLM.plan)."""
        h = self.model.embed_tokens(input_ids)  # (T, hidden)
        h = h * torch.tensor(self.config.hidden_size**0.5).to(h.dtype)
        return h, self.plan(positions, meta, kv_cache, h.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's layers without q/k norm (ModelConfig.qk_norm off) and one rope base for
    every layer (local_rope None), attention scores soft-capped by the attention backend
    (AttentionShape.softcap, from attn_logit_softcapping)."""
