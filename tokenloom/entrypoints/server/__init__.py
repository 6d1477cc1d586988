"""OpenAI-compatible HTTP server over AsyncLLMEngine (FastAPI + uvicorn).

``build_app`` is imported on first use: the CLI reads serve's flag defaults from this package
(admission.py) on every command, and FastAPI, pydantic and prometheus-client (~20 MiB of the
resident size, and their import time) belong only to ``serve``.
"""

from __future__ import annotations

from pathlib import Path


def served_model_name(model_path: str) -> str:
    """The id clients use: a GGUF file's stem, or the folder's name (its parent's for a prepared 'hf' folder)."""
    path = Path(model_path)
    if path.is_file():
        return path.stem
    return path.parent.name if path.name == "hf" else path.name


def served_names(model_arg: str | None, model_path: str, override: str | None = None) -> list[str]:
    """The ids a request may name the model by, the one /v1/models lists first: `override`
    (--served-model-name) alone, else the name it was pulled by (`--model NAME`, a Hub name as
    given, or the default model's) and the file or folder name."""
    if override:
        return [override]
    from tokenloom.loader.hf_hub import is_hub_name
    from tokenloom.loader.hub import DEFAULT_NAME, MODELS

    pulled: str | None
    if not model_arg:
        pulled = DEFAULT_NAME
    elif is_hub_name(model_arg):
        pulled = model_arg
    else:
        pulled = model_arg if model_arg in MODELS and not Path(model_arg).exists() else None
    stem = served_model_name(model_path)
    return [pulled, stem] if pulled and pulled != stem else [stem]


def __getattr__(name: str):
    if name == "build_app":
        from tokenloom.entrypoints.server.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["build_app", "served_model_name", "served_names"]
