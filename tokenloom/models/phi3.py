"""Phi-3 / Phi-3.5 / Phi-4: a Llama-shaped decoder whose checkpoints store q/k/v as one
``qkv_proj`` and gate/up as one ``gate_up_proj`` (tokenloom's own fused layout, so they load
as they stand), with longrope scaling (Phi-3 128k, Phi-3.5) and partial rotary (Phi-4-mini)
from ModelConfig. Sliding windows (Phi-3-mini-4k) apply to every layer, as in transformers.
"""

from __future__ import annotations

from typing import ClassVar

from tokenloom.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | None]]] = {}
