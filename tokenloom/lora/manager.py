"""The LoRA adapters an engine holds: projections given slots, adapters loaded into them by name.

``LoRAManager(model, ...)`` wraps the attention projections (q/k/v, o) and the dense MLP's
(gate/up, down) of every decoder layer in ``LoRALinear`` with ``max_loras`` slots of rank up to
``max_lora_rank``; ``prepare(name, path)`` reads a PEFT folder or GGUF LoRA file and checks every
factor against the module it names (a base/adapter mismatch is a ValueError saying which module and
shape), on any thread; ``add`` writes a prepared adapter (or reads one first) into a free slot. A
request names its adapter; its rows of each step use that slot (``set_rows``), others the base
alone, in the same batch.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenloom.lora.gguf_adapter import gguf_stored_dtype, is_gguf, read_gguf_adapter
from tokenloom.lora.layers import LoRALinear, StepRows, features
from tokenloom.lora.peft import LoRAFactors, PeftAdapter, peft_stored_dtype, read_peft_adapter

# the projections that take adapters: each decoder layer's attention and dense MLP
_TARGET = re.compile(r".*layers\.\d+\.(?:self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj))")
_GROUPS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
_uids = itertools.count(1)


@dataclass(frozen=True)
class AdapterRef:
    """A loaded adapter: the slot its rows use, and the root its prompt blocks' prefix-cache hashes
    chain from (two adapters, or an adapter and the base, never share cached KV)."""

    name: str
    slot: int
    root: int
    path: str
    rank: int
    base_model: str | None = None


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read and checked against one model, not yet in a slot: its factors per wrapped
    layer, per output group (``LoRAManager.prepare``)."""

    adapter: PeftAdapter
    factors: dict[str, dict[int, LoRAFactors]]


def storage_dtype(choice: str, paths: list[str]) -> torch.dtype:
    """The slots' dtype for `choice` (auto: bfloat16 or float16 where every adapter in `paths` is stored
    so: their own precision (the scaling folded into B rounds there) at half float32's bytes; else float32)."""
    if choice != "auto":
        return getattr(torch, choice)
    stored = {gguf_stored_dtype(p) if is_gguf(p) else peft_stored_dtype(p) for p in paths}
    if len(stored) == 1 and (only := stored.pop()) in (torch.bfloat16, torch.float16):
        return only
    return torch.float32


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        max_rows: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """`max_rows`: the most tokens a forward takes; `dtype`: how the slots store factors."""
        self.model, self.max_loras, self.max_rank, self.dtype = model, max_loras, max_rank, dtype
        self.rows = StepRows(model, max_rows, device)
        self.layers = _install(model, max_loras, max_rank, self.rows, device, dtype)
        if not self.layers:
            raise ValueError(
                f"LoRA adapters are not supported for {type(model).__name__}: it has no projections named "
                "as Llama's (self_attn.q/k/v/o_proj, mlp.gate/up/down_proj)"
            )
        self.adapters: dict[str, AdapterRef] = {}

    def prepare(self, name: str, path: str | Path) -> PreparedAdapter:
        """Read the adapter at `path` (to be loaded as `name`) and check it against this model
        (ValueError naming the mismatch). Touches no slot, so it may run on any thread while steps run."""
        adapter = self._read(path)
        return PreparedAdapter(adapter, self._factors_by_layer(adapter, name))

    def add(self, name: str, source: str | Path | PreparedAdapter) -> AdapterRef:
        """Load the adapter at `source` (a path, or one ``prepare`` read) under `name` into a free slot;
        ValueError when the name is taken, every slot is in use, or the adapter does not fit this
        model (nothing changes then)."""
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        free = sorted(set(range(self.max_loras)) - {a.slot for a in self.adapters.values()})
        if not free:
            raise ValueError(
                f"cannot load LoRA adapter {name!r}: all {self.max_loras} slots are in use "
                f"({', '.join(self.adapters)}); unload one or raise --max-loras"
            )
        prepared = source if isinstance(source, PreparedAdapter) else self.prepare(name, source)
        adapter, slot = prepared.adapter, free[0]
        for layer_name, factors in prepared.factors.items():
            self.layers[layer_name].load_slot(slot, factors)
        ref = AdapterRef(name, slot, hash(("lora", next(_uids))), str(adapter.path), adapter.rank, adapter.base_model)
        self.adapters[name] = ref
        return ref

    def _read(self, path: str | Path) -> PeftAdapter:
        """A PEFT folder, or a GGUF LoRA file (llama.cpp's convert_lora_to_gguf.py)."""
        if is_gguf(path):
            config: Any = self.model.config
            return read_gguf_adapter(path, config.num_heads, config.num_kv_heads)
        return read_peft_adapter(path)

    def remove(self, name: str) -> None:
        """Free `name`'s slot (the caller makes sure no request uses it); KeyError if not loaded."""
        ref = self.adapters.pop(name)
        for layer in self.layers.values():
            layer.clear_slot(ref.slot)

    def set_rows(self, runs: list[tuple[int, int]]) -> None:
        """The step's (slot, rows) per sequence, in batch order (-1: the base model)."""
        self.rows.set(runs)

    def _factors_by_layer(self, adapter: PeftAdapter, name: str) -> dict[str, dict[int, LoRAFactors]]:
        """The adapter's factors as the wrapped layers take them: per layer, per output group."""
        mapping = getattr(type(self.model), "packed_modules_mapping", {})
        out: dict[str, dict[int, LoRAFactors]] = {}
        for module, f in adapter.modules.items():
            prefix, _, leaf = module.rpartition(".")
            ours, shard = mapping.get(leaf, (leaf, None))
            target = f"{prefix}.{ours}" if prefix else ours
            layer = self.layers.get(target)
            if layer is None:
                raise ValueError(
                    f"LoRA adapter {name!r} has weights for {module}, which this model "
                    f"({type(self.model).__name__}) {_why_missing(target, self.model)}" + _trained_for(adapter)
                )
            if f.rank > self.max_rank:
                raise ValueError(
                    f"LoRA adapter {name!r} has rank {f.rank} at {module}, above --max-lora-rank {self.max_rank}"
                )
            if f.A.shape[1] != layer.in_features:
                raise ValueError(
                    f"LoRA adapter {name!r} does not fit this model: {module}'s lora_A takes {f.A.shape[1]} inputs, "
                    f"the model's projection takes {layer.in_features}" + _trained_for(adapter)
                )
            rows = getattr(self.model, "checkpoint_rows", lambda _n: None)(f"{module}.weight")
            B = f.B if rows is None else f.B[rows]
            groups = range(len(layer.group_names)) if shard is None else [layer.group_names.index(shard)]
            expected = sum(layer.group_rows(g) for g in groups)
            if B.shape[0] != expected:
                raise ValueError(
                    f"LoRA adapter {name!r} does not fit this model: {module}'s lora_B has {B.shape[0]} outputs, "
                    f"the model's has {expected}" + _trained_for(adapter)
                )
            for g in groups:  # a whole fused module's B is split by group; each reads the same A
                lo = layer.bounds[g] - layer.bounds[groups[0]]
                out.setdefault(target, {})[g] = LoRAFactors(f.A, B[lo : lo + layer.group_rows(g)].contiguous())
        return out


def _install(model: Any, slots: int, max_rank: int, rows: StepRows, device, dtype) -> dict[str, LoRALinear]:
    layers: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        if not _TARGET.fullmatch(name) or isinstance(module, LoRALinear):
            continue
        leaf = name.rsplit(".", 1)[1]
        out_features = features(module)[1]
        groups: tuple[str | None, ...] = _GROUPS.get(leaf, (None,))
        bounds = [0]
        try:
            for g in groups:
                part = model.shard_rows(f"{name}.weight", g) if g is not None else None
                bounds.append(part.stop if part is not None else out_features)
        except (KeyError, AttributeError):  # a checkpoint already fused (Phi-3): one group
            groups, bounds = (None,), [0, out_features]
        if bounds[-1] != out_features:  # more than its shards (Qwen3-Next's gated q): no LoRA
            continue
        wrapped = LoRALinear(module, bounds, groups, slots, max_rank, rows, device, dtype)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, wrapped)
        layers[name] = wrapped
    return layers


def _why_missing(target: str, model: nn.Module) -> str:
    try:
        model.get_submodule(target)
    except AttributeError:
        return "does not have (an adapter for another model?)"
    return "takes no LoRA (adapters apply to the attention and dense MLP projections)"


def _trained_for(adapter: PeftAdapter) -> str:
    return f" (the adapter was trained for {adapter.base_model})" if adapter.base_model else ""
