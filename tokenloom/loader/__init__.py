"""Checkpoint loading: HF folders (safetensors) and GGUF files."""

from tokenloom.loader.load import CheckpointError, LoadedModel, load_model

__all__ = ["CheckpointError", "LoadedModel", "load_model"]
