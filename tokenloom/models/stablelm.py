"""StableLM (StableLM 2, StableLM-3B-4E1T, Zephyr, StableCode): a Llama-shaped decoder with
GPT-NeoX's habits, as transformers' StableLmForCausalLM does it:
- LayerNorm with a bias (not RMSNorm) before attention, before the MLP and at the end;
- rope over the first partial_rotary_factor of each head (0.25 by default);
- optional q/k/v bias (use_qkv_bias) and per-head q/k LayerNorm with a weight per head
  (qk_layernorm, StableLM 2 12B);
- optional parallel residual (use_parallel_residual): attention and the MLP both read the
  same normed input and join the stream together, x + attn(ln(x)) + mlp(ln(x)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.attention.backend import StepAttention
from tokenloom.layers.mlp import GatedMLP
from tokenloom.models.config import ModelConfig
from tokenloom.models.llama import LlamaAttention, LlamaForCausalLM


class PerHeadLayerNorm(nn.Module):
    """LayerNorm without bias over each head's row, each head with its own weight (checkpoint
    names ``norms.{head}.weight``): x (T * heads, head_dim), head-major per token -> same shape."""

    def __init__(self, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        self.norms = nn.ModuleList(nn.LayerNorm(head_dim, eps=eps, bias=False) for _ in range(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.stack([norm.weight for norm in self.norms])  # type: ignore[misc]  # torch: items typed Module; (heads, head_dim)
        rows = F.layer_norm(x.view(-1, self.heads, self.head_dim), (self.head_dim,), eps=self.eps)
        return (rows * weight).view(x.shape)


class StableLmAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if cfg.qk_norm:  # LayerNorms per head in place of Qwen3's RMSNorms
            del self.q_norm, self.k_norm
            self.q_layernorm = PerHeadLayerNorm(cfg.num_heads, cfg.head_dim, cfg.norm_eps)
            self.k_layernorm = PerHeadLayerNorm(cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps)
            self.norms = (self.q_layernorm, self.k_layernorm)


class StableLmDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = StableLmAttention(cfg)
        if not cfg.parallel_residual:
            self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)

    def forward(self, h: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        """h (T, hidden), the residual stream -> the stream after this layer."""
        normed = self.input_layernorm(h)
        attn = self.self_attn.forward(normed, attend, layer)
        if self.parallel_residual:
            return h + attn + self.mlp.forward(normed)
        h = h + attn
        return h + self.mlp.forward(self.post_attention_layernorm(h))


class StableLmForCausalLM(LlamaForCausalLM):
    """Loads HF ``StableLmForCausalLM`` checkpoints and GGUF ``stablelm`` files (see the module doc)."""

    decoder_layer = StableLmDecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def run_layers(self, h: torch.Tensor, attend: StepAttention) -> torch.Tensor:
        for i, layer in enumerate(self.model.layers):
            h = layer.forward(h, attend, i)
        return self.model.norm(h)
