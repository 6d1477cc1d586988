"""Granite 4.0-H (IBM's ``GraniteMoeHybridForCausalLM``, GGUF ``granitehybrid``): Granite's
multipliers and MoE (models/granite.py) around a hybrid of token mixers: most layers run a
Mamba-2 mixer (layers/mamba2.py; ModelConfig.recurrent.layers), the rest attention, by default
without rope (position_embedding_type "nope": positions come from the recurrent layers). Every
layer's MLP is the shared MLP plus, where the model has experts, the routed mixture.

The recurrent layers keep a state per sequence (kv_cache/recurrent.py) instead of keys and
values: only the attention layers use the paged KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tokenloom.attention.backend import StepAttention
from tokenloom.layers.mamba2 import Mamba2Mixer
from tokenloom.models.config import ModelConfig
from tokenloom.models.granite import GraniteDecoderLayer, GraniteMoeForCausalLM


class GraniteHybridDecoderLayer(GraniteDecoderLayer):
    """Granite's layer whose mixer is attention or, once ``make_recurrent`` ran, Mamba-2."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.recurrent = False

    def make_recurrent(self, cfg: ModelConfig) -> None:
        """Swap this layer's attention for a Mamba-2 mixer (HF's ``mamba.*`` weights)."""
        del self.self_attn
        self.mamba = Mamba2Mixer(cfg)
        self.recurrent = True

    def mix(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden) through the layer's Mamba-2 mixer or attention."""
        return (self.mamba if self.recurrent else self.self_attn).forward(x, attend, layer)


class GraniteMoeHybridForCausalLM(GraniteMoeForCausalLM):
    """Loads HF ``GraniteMoeHybridForCausalLM`` checkpoints and GGUF ``granitehybrid`` files."""

    decoder_layer = GraniteHybridDecoderLayer
    replayable_layers = False  # a step's recurrent layers choose their path per sequence in Python

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        assert cfg.recurrent is not None  # a hybrid names its recurrent layers
        for i in cfg.recurrent.layers:
            layer = self.model.layers[i]
            assert isinstance(layer, GraniteHybridDecoderLayer)  # decoder_layer above
            layer.make_recurrent(cfg)

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """GraniteMoe's renaming; without experts the shared MLP is the layer's MLP."""
        for name, tensor in super().checkpoint_tensors(tensors):
            if self.config.moe is None and ".mlp.shared_expert." in name:
                name = name.replace(".mlp.shared_expert.", ".mlp.")
            yield name, tensor
