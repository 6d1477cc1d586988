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
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

import torch

from tokenloom.models.config import UnsupportedModelError
from tokenloom.quant.gguf.blocks import exact_format
from tokenloom.quant.gguf.modules import GGMLEmbedding, GGMLLinear
from tokenloom.quant.gguf.tensor import KERNEL_TYPES, type_name
from tokenloom.quant.int8.modules import GGML_BLOCKS, QuantizedLinear
from tokenloom.quant.scheme import WeightFormat

QUANT_METHOD = "tokenloom"


OUTPUT_HEAD = "lm_head"


def formats_for(quantization: str | None, model_cls) -> Callable[[str], WeightFormat | None] | None:
    """Module name -> format for a checkpoint quantized while loading (`--quantization int8|int4...`)."""
    if quantization is None:
        return None
    fmt = WeightFormat.parse(quantization)
    # int4 keeps the output head (and so a tied embedding) at int8, as llama.cpp's quantizer
    # keeps output.weight at Q6_K/Q8_0: its error reaches every logit (SmolLM2 perplexity
    # +9.6% -> see docs/BENCHMARKS.md).
    head = WeightFormat.parse("int8") if fmt.bits == 4 else fmt
    return lambda name: head if name == OUTPUT_HEAD else fmt


def gguf_formats(tensor_types: dict[str, int], tied: bool, model_cls) -> Callable[[str], WeightFormat | str | None]:
    """Module name -> how a GGUF file's blocks are kept: a tokenloom format where every shard's
    type is that format as it stands (Q8_0, Q5_0, IQ4_NL -> int8; Q4_0, Q4_1 -> int4: the
    panel kernels), else ``GGML_BLOCKS`` (the GGML kernels, any mix of types); None (float)
    where a shard is a float type or a type without a kernel (dequantized, with a warning).
    An untied embedding keeps its blocks (rows dequantized on lookup)."""
    from tokenloom.loader.weights import map_name

    kinds_of: dict[str, list[int]] = {}
    for name, kind in tensor_types.items():
        if name.endswith(".weight"):
            module = map_name(model_cls, name)[0].removesuffix(".weight")
            kinds_of.setdefault(module, []).append(kind)
    plan: dict[str, WeightFormat | str] = {}
    for module, kinds in kinds_of.items():
        if all(k in KERNEL_TYPES for k in kinds):
            exact = {exact_format(k) for k in kinds}
            plan[module] = cast(WeightFormat, exact.pop()) if len(exact) == 1 and None not in exact else GGML_BLOCKS
    embedding = model_cls.input_embedding_name
    if embedding in plan:
        if tied:
            plan.setdefault(OUTPUT_HEAD, plan[embedding])
        plan[embedding] = GGML_BLOCKS
    return plan.get


def describe_weights(model: torch.nn.Module, tensor_types: dict[str, int]) -> str:
    """What the file holds and what each layer was kept as: 'file: Q5_0 x133, ...; layers: Q5_0 panels x48, ...'."""
    counts: Counter[str] = Counter()
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            counts[f"{mod.fmt.name} (exact)"] += 1
        elif isinstance(mod, GGMLLinear):
            counts["+".join(dict.fromkeys(mod.types))] += 1
        elif isinstance(mod, GGMLEmbedding) and not mod._tied:
            assert mod.weight_q is not None  # an untied embedding holds its own blocks, loaded
            counts[f"embedding {mod.weight_q.type_name} (rows on lookup)"] += 1
        elif isinstance(mod, torch.nn.Linear):
            counts["float32 linear"] += 1
    stored = Counter(type_name(k) for k in tensor_types.values())
    return (
        f"file: {', '.join(f'{n} x{c}' for n, c in stored.most_common())}; layers: "
        f"{', '.join(f'{n} x{c}' for n, c in counts.most_common())}"
    )


def saved_formats(hf_config: dict, quantization: str | None) -> dict[str, WeightFormat] | None:
    """The per-module formats of a folder saved by save_quantized (None for other checkpoints)."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":  # blocks read as GGUF's MXFP4 (CausalLM.stored_block_types), the rest float
        return None
    if method != QUANT_METHOD:
        raise UnsupportedModelError(
            f"checkpoints quantized with {method!r} are not supported; tokenloom "
            "loads float checkpoints, GGUF files and folders it quantized itself"
        )
    if quantization is not None and quantization != qc.get("scheme"):
        raise ValueError(
            f"this checkpoint is already quantized as {qc.get('scheme')}; "
            f"drop --quantization {quantization} (or pass the same scheme)"
        )
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
