"""GPT-2: learned positions, LayerNorm, fused qkv with biases, tanh-GELU MLP, tied head."""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.attention.backend import AttentionShape, StepAttention, plan_attention
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.layers.embedding import uninitialized_embedding
from tokenloom.layers.mlp import activation
from tokenloom.models.base import CausalLM
from tokenloom.models.config import ModelConfig


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.hidden = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        return self.c_proj(attend(layer, self.c_attn(x)))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, h: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h), attend, layer)
        return h + self.mlp(self.ln_2(h))


class GPT2Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = uninitialized_embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = uninitialized_embedding(cfg.learned_positions, cfg.hidden_size)  # the checkpoint's rows
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class GPT2LMHeadModel(CausalLM):
    # HF GPT-2 stores the causal mask as a buffer in older checkpoints.
    input_embedding_name = "transformer.wte"
    ignored_checkpoint_keys = (r"transformer\.h\.\d+\.attn\.(masked_)?bias",)
    # HF GPT-2 uses Conv1D, whose weight is (in, out): the transpose of nn.Linear's.
    _conv1d_suffixes = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.transformer = GPT2Transformer(cfg)
        self.attention_shape = AttentionShape(cfg.num_heads, cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):  # not when quantized
            self.lm_head.weight = self.transformer.wte.weight

    def transform_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if name.endswith(self._conv1d_suffixes) else tensor

    def forward(self, input_ids, positions, meta, kv_cache: PagedKVCache):
        t = self.transformer
        h = t.wte(input_ids) + t.wpe(positions)  # (T, hidden)
        attend = plan_attention(self.attention_shape, meta, kv_cache, None)
        for i, block in enumerate(t.h):
            h = block(h, attend, i)
        return t.ln_f(h)
