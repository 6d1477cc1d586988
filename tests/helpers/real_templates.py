"""The chat templates of released models (tests/tool_calling/templates, as their tokenizer configs
ship them), rendered the way tokenloom renders a model's template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenloom.tokenizer import compile_chat_template

TEMPLATES = Path(__file__).resolve().parents[1] / "tool_calling" / "templates"


def real_template(name: str) -> str:
    """The template text of `name` (a file stem in TEMPLATES)."""
    return (TEMPLATES / f"{name}.jinja").read_text()


def render(name: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """`messages` through template `name` as Tokenizer.apply_chat_template renders them."""
    kwargs.setdefault("bos_token", "<s>")
    kwargs.setdefault("eos_token", "</s>")
    template = compile_chat_template(real_template(name))
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
