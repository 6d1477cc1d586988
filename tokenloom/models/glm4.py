"""GLM-4 (``Glm4ForCausalLM``): a Llama-shaped decoder with Gemma 3's four norms a layer.

What differs from models/llama.py, as transformers' Glm4ForCausalLM does it:
- attention and MLP outputs are normed before they join the residual stream
  (post_self_attn_layernorm, post_mlp_layernorm), with post_attention_layernorm before the MLP:
  Gemma 3's layer (models/gemma.py), under GLM's names and with plain RMSNorm weights;
- rope turns half of each head (partial_rotary_factor 0.5) in interleaved pairs (dims 2i, 2i+1),
  not rotate-half (i, i + d/2). Attention scores depend on q and k only through their dot
  products, so q and k rows read in the order [0, 2, 4, ..., 1, 3, 5, ...] of each head's rotated
  dims (``checkpoint_rows``) make the rotate-half kernels compute GLM's scores exactly;
- q/k/v biases, no output bias, the MLP's gate and up stored as one gate_up_proj.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tokenloom.models.config import ModelConfig
from tokenloom.models.gemma import Gemma3DecoderLayer
from tokenloom.models.llama import LlamaForCausalLM


def interleaved_to_halves(head_dim: int, rotary_dim: int, heads: int) -> torch.Tensor:
    """Row order (heads * head_dim,) that turns each head's interleaved rotary pairs (2i, 2i + 1)
    into rotate-half pairs (i, i + rotary_dim / 2); dims past rotary_dim stay where they are."""
    # on the CPU: models are built under torch.device("meta"), and an index is read, not loaded
    cpu = torch.device("cpu")
    halves = [torch.arange(0, rotary_dim, 2, device=cpu), torch.arange(1, rotary_dim, 2, device=cpu)]
    one = torch.cat([*halves, torch.arange(rotary_dim, head_dim, device=cpu)])
    return torch.cat([one + h * head_dim for h in range(heads)])


class Glm4ForCausalLM(LlamaForCausalLM):
    """Loads HF ``Glm4ForCausalLM`` checkpoints and GGUF ``glm4`` files (see the module doc)."""

    decoder_layer: ClassVar[type[nn.Module]] = Gemma3DecoderLayer
    # GLM's norm names onto Gemma 3's layer, applied in this order (one rename each); q/k/v into
    # qkv_proj; gate_up_proj is stored whole
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | None]]] = {
        "post_attention_layernorm": ("pre_feedforward_layernorm", None),
        "post_self_attn_layernorm": ("post_attention_layernorm", None),
        "post_mlp_layernorm": ("post_feedforward_layernorm", None),
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self._q_rows = interleaved_to_halves(cfg.head_dim, cfg.rotary_dim, cfg.num_heads)
        self._k_rows = interleaved_to_halves(cfg.head_dim, cfg.rotary_dim, cfg.num_kv_heads)

    def checkpoint_rows(self, name: str) -> torch.Tensor | None:
        """q and k projections (weights and biases) read with each head's rotary pairs re-ordered."""
        if ".self_attn.q_proj." in name:
            return self._q_rows
        if ".self_attn.k_proj." in name:
            return self._k_rows
        return None
