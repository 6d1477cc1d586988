"""OLMo 2: a Llama-shaped decoder whose norms come after each block, not before.

What differs from models/llama.py, as transformers' Olmo2ForCausalLM does it:
- no input or pre-MLP norm: attention and the MLP read the residual stream itself, and their
  outputs are normed (post_attention_layernorm, post_feedforward_layernorm) before they join it;
- q and k are RMS-normed over the whole projection (all heads at once), before the heads are split.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.attention.backend import StepAttention
from tokenloom.layers.mlp import GatedMLP
from tokenloom.layers.norms import RMSNorm
from tokenloom.models.config import ModelConfig
from tokenloom.models.llama import LlamaAttention, LlamaForCausalLM


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)  # cfg.qk_norm is off: these norms span every head
        self.q_norm = RMSNorm(self.q_size, cfg.norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.norm_eps)

    def forward(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)  # (T, q_size + 2 kv_size)
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        qkv = torch.cat(
            [
                self.q_norm.forward(q.contiguous()),
                self.k_norm.forward(k.contiguous()),
                qkv[:, self.q_size + self.kv_size :],
            ],
            dim=-1,
        )
        return self.o_proj.forward(attend(layer, qkv))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, attend: StepAttention, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's normed MLP output (the embeddings for layer 0, residual None)
        -> (this layer's normed MLP output, the residual stream before it is added)."""
        stream = x if residual is None else residual + x
        stream = stream + self.post_attention_layernorm.forward(self.self_attn.forward(stream, attend, layer))
        return self.post_feedforward_layernorm.forward(self.mlp.forward(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Loads HF ``Olmo2ForCausalLM`` checkpoints (see the module doc): Llama's forward over
    OLMo 2's layers."""

    decoder_layer = Olmo2DecoderLayer
