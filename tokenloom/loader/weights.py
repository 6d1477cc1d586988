"""Copy checkpoint tensors into a model, accounting for every one of them.

A checkpoint tensor that maps onto no parameter, a parameter (or fused shard)
that no tensor fills, and a shape mismatch are all errors that name the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch

from tokenloom.models.base import CausalLM
from tokenloom.quant.gguf.modules import GGMLEmbedding
from tokenloom.quant.gguf.tensor import GGMLTensor
from tokenloom.quant.int8.formats import QuantizedTensor
from tokenloom.quant.int8.modules import QuantizedEmbedding, quantized_targets


class WeightMismatchError(ValueError):
    """The checkpoint's tensors do not match the model's parameters."""


def map_name(model: CausalLM | type[CausalLM], name: str) -> tuple[str, str | None]:
    """Checkpoint tensor name -> (parameter name, shard id or None). Every mapping whose
    checkpoint sub-name occurs is applied (Mixtral: block_sparse_moe -> mlp and w1 -> gate_up_proj)."""
    found = None
    for ckpt_sub, (our_sub, shard) in model.packed_modules_mapping.items():
        if f".{ckpt_sub}." in name:
            name = name.replace(f".{ckpt_sub}.", f".{our_sub}.")
            found = shard if shard is not None else found
    return name, found


def _expected_shards(model: CausalLM, param_name: str) -> set[str | None]:
    shards: set[str | None] = {
        shard
        for ckpt_sub, (our_sub, shard) in model.packed_modules_mapping.items()
        if shard is not None and f".{our_sub}." in param_name
    }
    return shards or {None}


def _tied_alias_names(model: CausalLM) -> set[str]:
    """Names under which a tied parameter also appears (HF checkpoints may store both)."""
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return all_names - {n for n, _ in model.named_parameters()}


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor | QuantizedTensor | GGMLTensor]]) -> None:
    """Fill every parameter of `model` from (name, tensor) pairs in HF naming (in place).

    A tensor may be a QuantizedTensor or a GGMLTensor (GGUF blocks); a quantized layer takes
    it as is where the formats match, and a float parameter takes it dequantized.
    """
    params = dict(model.named_parameters())
    quantized = quantized_targets(model)
    aliases = _tied_alias_names(model)
    filled: dict[str, set[str | None]] = {n: set() for n in params}
    filled_quantized: dict[int, set[str | None]] = {}
    for name, tensor in model.checkpoint_tensors(tensors):
        if model.is_ignored_checkpoint_key(name) or name in aliases:
            continue
        param_name, shard = map_name(model, name)
        order = model.checkpoint_rows(name)
        if order is not None:
            tensor = tensor.rows(order) if isinstance(tensor, (GGMLTensor, QuantizedTensor)) else tensor[order]
        if param_name in quantized:
            owner = _load_quantized(model, quantized[param_name], name, param_name, shard, tensor)
            filled_quantized.setdefault(id(owner), set()).add(shard)
            continue
        if param_name not in params:
            raise WeightMismatchError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        if isinstance(tensor, GGMLTensor):  # GGUF blocks are rows of nn.Linear's layout already
            tensor = tensor.dequantize()
        else:
            assert isinstance(tensor, torch.Tensor)  # QuantizedTensors fill quantized modules only
            tensor = model.transform_checkpoint_tensor(name, tensor)
        target = params[param_name].data
        if shard is not None:
            target = target[model.shard_rows(param_name, shard)]
        if tuple(target.shape) != tuple(tensor.shape):
            raise WeightMismatchError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor.to(target.dtype))
        filled[param_name].add(shard)
    missing = [
        f"{n}" + (f" ({sorted(cast('set[str]', s - filled[n]))})" if s - filled[n] != {None} else "")
        for n in params
        if (s := _expected_shards(model, n)) - filled[n]
    ]
    missing += [
        n
        for n, mod in quantized.items()
        if not _is_tied_embedding(mod) and _expected_shards(model, n) - filled_quantized.get(id(mod), set())
    ]
    if missing:
        listed = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise WeightMismatchError(f"checkpoint is missing {len(missing)} of the model's tensors: {listed}")


def _load_quantized(model: CausalLM, target, name: str, param_name: str, shard: str | None, tensor):
    """Load one checkpoint tensor into a quantized module; returns the module that owns the data."""
    if isinstance(tensor, torch.Tensor):
        tensor = model.transform_checkpoint_tensor(name, tensor)
    rows = model.shard_rows(param_name, shard) if shard is not None else None
    try:
        target.load_weight(tensor, rows)
    except ValueError as e:
        raise WeightMismatchError(f"checkpoint tensor {name!r}: {e}") from e
    return target._tied[0] if _is_tied_embedding(target) else target


def _is_tied_embedding(module) -> bool:
    """An embedding that reads a quantized output projection's rows (filled through it)."""
    return isinstance(module, (QuantizedEmbedding, GGMLEmbedding)) and bool(module._tied)
