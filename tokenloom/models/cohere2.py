"""Cohere 2 (Command R7B, Command A: ``Cohere2ForCausalLM``), as transformers' Cohere2ForCausalLM does it:
- one LayerNorm without bias per layer, and attention and the MLP side by side on its output:
  x + attn(ln(x)) + mlp(ln(x)) (StableLM's parallel residual, models/stablelm.py);
- three sliding-window layers to one full-attention layer; the sliding layers turn q and k by rope
  (in interleaved pairs: ModelConfig.rope_interleaved), the full layers attend without rope
  (ModelConfig.rope_layers);
- logits times logit_scale (ModelConfig.logit_scale); tied embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.models.config import ModelConfig
from tokenloom.models.stablelm import StableLmDecoderLayer, StableLmForCausalLM


class Cohere2DecoderLayer(StableLmDecoderLayer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)  # cfg.parallel_residual: no post-attention norm
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=False)


class Cohere2ForCausalLM(StableLmForCausalLM):
    """Loads HF ``Cohere2ForCausalLM`` checkpoints and GGUF ``cohere2`` files (see the module doc)."""

    decoder_layer = Cohere2DecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.config.logit_scale
