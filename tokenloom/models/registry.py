"""HF architecture name -> model class, imported lazily."""

from __future__ import annotations

import importlib

from tokenloom.config import ModelConfig, UnsupportedModelError
from tokenloom.models.base import CausalLM

_REGISTRY = {
    "LlamaForCausalLM": ("tokenloom.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenloom.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tokenloom.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("tokenloom.models.llama", "LlamaForCausalLM"),
    "GPT2LMHeadModel": ("tokenloom.models.gpt2", "GPT2LMHeadModel"),
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The CausalLM subclass that implements ``config.architecture``."""
    if config.architecture not in _REGISTRY:
        raise UnsupportedModelError(f"architecture {config.architecture!r} is not supported "
                                    f"(supported: {', '.join(_REGISTRY)})")
    module, name = _REGISTRY[config.architecture]
    return getattr(importlib.import_module(module), name)
