"""Which layers get which format when loading, and quantized folders saved and loaded again.

A folder saved by ``save_quantized`` is an HF-style folder whose safetensors hold
each quantized layer's ``qweight``/``scales``/``offsets`` under tokenloom's own
module names, and whose config.json says so::

    "quantization_config": {"quant_method": "tokenloom", "scheme": "int4-g32",
                            "modules": {"model.layers.0.self_attn.qkv_proj": "int4-g32", ...}}

Loading it rebuilds those modules and copies the tensors: no re-quantization.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from tokenloom.config import UnsupportedModelError
from tokenloom.quant.scheme import WeightFormat

QUANT_METHOD = "tokenloom"


OUTPUT_HEAD = "lm_head"


def formats_for(quantization: str | None, ckpt, model_cls) -> Callable[[str], WeightFormat | None] | None:
    """Module name -> format for a float or GGUF checkpoint loaded with `--quantization`."""
    if quantization is None:
        return None
    if quantization != "gguf":
        fmt = WeightFormat.parse(quantization)
        # int4 keeps the output head (and so a tied embedding) at int8, as llama.cpp's quantizer
        # keeps output.weight at Q6_K/Q8_0: its error reaches every logit (SmolLM2 perplexity
        # +9.6% -> see docs/BENCHMARKS.md).
        head = WeightFormat.parse("int8") if fmt.bits == 4 else fmt
        return lambda name: head if name == OUTPUT_HEAD else fmt
    if ckpt.block_formats is None:
        raise ValueError("--quantization gguf keeps a GGUF file's own Q8_0/Q4_0/Q4_1 blocks, "
                         "but this checkpoint is not a GGUF file; use int8 or int4")
    formats: dict[str, WeightFormat] = {}
    for name, fmt in ckpt.block_formats.items():
        module = name.removesuffix(".weight")
        for ckpt_sub, (our_sub, _) in model_cls.packed_modules_mapping.items():
            module = module.replace(f".{ckpt_sub}", f".{our_sub}") if module.endswith(f".{ckpt_sub}") else module
        formats.setdefault(module, fmt)     # a fused layer takes its first shard's format
    if ckpt.hf_config.get("tie_word_embeddings") and model_cls.input_embedding_name in formats:
        formats.setdefault("lm_head", formats[model_cls.input_embedding_name])
    return formats.get


def saved_formats(hf_config: dict, quantization: str | None) -> dict[str, WeightFormat] | None:
    """The per-module formats of a folder saved by save_quantized (None for other checkpoints)."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise UnsupportedModelError(f"checkpoints quantized with {method!r} are not supported; tokenloom "
                                    "loads float checkpoints, GGUF files and folders it quantized itself")
    if quantization is not None and quantization != qc.get("scheme"):
        raise ValueError(f"this checkpoint is already quantized as {qc.get('scheme')}; "
                         f"drop --quantization {quantization} (or pass the same scheme)")
    return {name: WeightFormat.parse(fmt) for name, fmt in qc["modules"].items()}


def load_saved_state(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy a saved quantized folder's tensors into the (already quantized) model."""
    from tokenloom.loader.weights import WeightMismatchError
    state = dict(tensors)
    result = model.load_state_dict(state, strict=False)
    problems = [f"missing {k}" for k in result.missing_keys] + [f"unexpected {k}" for k in result.unexpected_keys]
    if problems:
        raise WeightMismatchError(f"quantized checkpoint does not match the model: {', '.join(problems[:8])}")


def describe(folder: str | Path) -> dict:
    """The quantization_config of a saved folder (for messages and tests)."""
    return json.loads((Path(folder) / "config.json").read_text()).get("quantization_config", {})
