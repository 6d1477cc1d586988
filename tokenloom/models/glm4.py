"""GLM-4 (``Glm4ForCausalLM``): a Llama-shaped decoder with Gemma 3's four norms a layer.

What differs from models/llama.py, as transformers' Glm4ForCausalLM does it:
- attention and MLP outputs are normed before they join the residual stream
  (post_self_attn_layernorm, post_mlp_layernorm), with post_attention_layernorm before the MLP:
  Gemma 3's layer (models/gemma.py), under GLM's names and with plain RMSNorm weights;
- rope turns half of each head (partial_rotary_factor 0.5) in interleaved pairs (dims 2i, 2i+1),
  not rotate-half (i, i + d/2): ModelConfig.rope_interleaved, q and k rows read re-ordered at
  load (LlamaForCausalLM.checkpoint_rows) so the rotate-half kernels compute GLM's scores exactly;
- q/k/v biases, no output bias, the MLP's gate and up stored as one gate_up_proj.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from tokenloom.models.gemma import Gemma3DecoderLayer
from tokenloom.models.llama import LlamaForCausalLM


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
