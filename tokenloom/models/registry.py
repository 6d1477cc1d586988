"""HF architecture name -> model class (architectures.py's table), imported lazily."""

from __future__ import annotations

import importlib

from tokenloom.models.architectures import ARCHITECTURES
from tokenloom.models.base import CausalLM
from tokenloom.models.config import ModelConfig, UnsupportedModelError


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The CausalLM subclass that implements ``config.architecture``."""
    arch = ARCHITECTURES.get(config.architecture)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return getattr(importlib.import_module(arch.module), arch.class_name)
