"""A PEFT LoRA adapter folder read into per-module low-rank factors, as PEFT computes them.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``), with tensors
named ``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r). PEFT's
forward adds ``scaling * B (A x)`` to the module's output, scaling = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)), with ``rank_pattern`` / ``alpha_pattern`` overriding r and alpha per module.
What tokenloom does not apply (DoRA, LoRA biases, trained copies of whole modules, embeddings or the
output head, Conv1D layouts) is a ValueError naming it, never ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight")


@dataclass
class LoRAFactors:
    """One module's adapter: delta(x) = B (A x), the scaling folded into B."""

    A: torch.Tensor  # (r, in_features) float32
    B: torch.Tensor  # (out_features, r) float32, times the scaling

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass
class PeftAdapter:
    """An adapter as stored: its modules' factors by the base checkpoint's module names."""

    path: Path
    modules: dict[str, LoRAFactors]  # e.g. "model.layers.0.self_attn.q_proj"
    base_model: str | None  # base_model_name_or_path, for error messages

    @property
    def rank(self) -> int:
        return max(f.rank for f in self.modules.values())


def read_peft_adapter(path: str | Path) -> PeftAdapter:
    """The adapter in folder `path`; ValueError for a folder that is not a LoRA adapter tokenloom
    applies (naming the file, key or option)."""
    folder = Path(path).expanduser()
    config_file = folder / CONFIG_FILE
    if not folder.exists():
        raise ValueError(f"LoRA adapter {folder}: no such file or folder")
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a PEFT adapter folder: it has no {CONFIG_FILE}")
    config = json.loads(config_file.read_text())
    _check_options(config, folder)
    tensors = _read_tensors(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"{folder}: tensor {key!r} is not a LoRA factor (lora_A/lora_B); {_unsupported(key)}")
        pairs.setdefault(m["module"], {})[m["which"]] = tensor
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{folder}: {module} has lora_{''.join(ab)} without its pair")
        A, B = ab["A"].float(), ab["B"].float()
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise ValueError(f"{folder}: {module}'s lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} do not pair")
        r = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", 8))
        if r != A.shape[0]:
            raise ValueError(f"{folder}: {module} has rank {A.shape[0]} but the config says r={r}")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        modules[module] = LoRAFactors(A.contiguous(), (B * scaling).contiguous())
    if not modules:
        raise ValueError(f"{folder}: the adapter has no LoRA weights")
    return PeftAdapter(folder, modules, config.get("base_model_name_or_path"))


def peft_stored_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype a PEFT folder's factors are stored in (its first tensor's), None if unreadable."""
    file = Path(path).expanduser() / WEIGHT_FILES[0]
    if not file.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        names = list(f.keys())
        kind = f.get_slice(names[0]).get_dtype() if names else None
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(kind or "")


def _check_options(config: dict, folder: Path) -> None:
    """ValueError naming the first option whose effect tokenloom does not reproduce."""
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"{folder}: peft_type {kind!r} is not supported (only LORA adapters)")
    refused = [
        ("use_dora", "DoRA (use_dora) adapters are not supported"),
        ("lora_bias", "LoRA biases (lora_bias) are not supported"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D layouts, GPT-2) is not supported"),
        ("modules_to_save", "adapters that train whole modules (modules_to_save) are not supported"),
        ("layer_replication", "layer_replication is not supported"),
        ("trainable_token_indices", "trainable_token_indices is not supported"),
    ]
    for key, why in refused:
        if config.get(key):
            raise ValueError(f"{folder}: {why}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{folder}: bias={config['bias']!r} is not supported (only 'none')")


def _unsupported(key: str) -> str:
    if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
        return "LoRA on the embeddings and the output head (lm_head) is not supported"
    if "magnitude" in key:
        return "DoRA is not supported"
    return "only lora_A/lora_B weights are supported"


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = folder / name
        if file.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
    raise ValueError(f"{folder} has no adapter weights ({' or '.join(WEIGHT_FILES)})")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module override: the first pattern matching the module's name at a dot boundary."""
    for pattern, value in patterns.items():
        if pattern == module or re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
