"""OpenAI-compatible HTTP server over AsyncLLMEngine (FastAPI + uvicorn)."""

from __future__ import annotations

from pathlib import Path

from tokenloom.server.app import build_app


def served_model_name(model_path: str) -> str:
    """The id clients use: a GGUF file's stem, or the folder's name (its parent's for a prepared 'hf' folder)."""
    path = Path(model_path)
    if path.is_file():
        return path.stem
    return path.parent.name if path.name == "hf" else path.name


__all__ = ["build_app", "served_model_name"]
