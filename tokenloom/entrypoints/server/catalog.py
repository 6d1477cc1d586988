"""What ``tokenloom serve`` can serve by name, and how it loads a model on demand.

The catalog is the model ``--model`` gave (loaded at start) and every model ``tokenloom list``
knows here: the packaged models pulled, and the Hugging Face Hub models in the cache (a GGUF
repo once per quant, ORG/REPO:QUANT; an HF folder as ORG/REPO). Each loads with serve's engine
flags, less what only fits the model they were given for: a draft model for speculative
decoding, and a split over processes (``-tp``/``-pp``: only the ``--model`` model is split; a
server that splits its model serves that one alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from tokenloom.engine.args import EngineArgs
from tokenloom.entrypoints.server import served_names
from tokenloom.entrypoints.server.load_policy import ModelEntry


def known_models(primary_path: str) -> list[ModelEntry]:
    """The pulled packaged models and the cached Hub models, less the one at `primary_path`."""
    from tokenloom.loader import hf_hub, hub

    primary = Path(primary_path).resolve()
    entries = []
    for m in hub.listing():
        if m["pulled"] and Path(m["path"]).resolve() != primary:
            names = served_names(m["name"], m["path"])
            entries.append(ModelEntry(names[0], m["name"], tuple(names[1:]), m["size"]))
    for m in hf_hub.cached_models():
        if not primary.is_relative_to(Path(m["path"]).resolve()):
            entries.append(ModelEntry(m["name"], m["name"], (), m["size"]))
    return entries


def engine_loader(options: EngineArgs, primary_path: str) -> Callable[[str], object] | None:
    """``load(source) -> LLMEngine`` with `options`' engine flags (a draft model and LoRA adapters
    only for the model at `primary_path`, the one they were given for); None where the server's
    model is split over processes (it then serves that model alone)."""
    if options.tensor_parallel_size * options.pipeline_parallel_size > 1:
        return None
    spec = options.speculative
    others = dataclasses.replace(options, lora=None, enable_lora=False)
    if spec is not None and "draft" in str(spec):
        others = dataclasses.replace(others, speculative=None)

    def load(source: str):
        from tokenloom.engine import LLMEngine

        chosen = options if source == primary_path else others
        return LLMEngine(dataclasses.replace(chosen, model=source).create_engine_config(), progress=True)

    return load
