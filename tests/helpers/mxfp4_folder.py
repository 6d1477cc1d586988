"""An HF gpt-oss folder with its experts in MXFP4, as OpenAI ships gpt-oss: each stacked expert
matrix as `<name>_blocks` (experts, out, in / 32, 16) uint8, HF's nibble order (byte j: value 2j
low, 2j + 1 high), and `<name>_scales` (experts, out, in / 32) e8m0 bytes; the config's
quantization_config names mxfp4. Quantized by the `gguf` package's MXFP4 (so a GGUF written from
the same float folder holds the same blocks), then re-laid in HF's order here, independently of
tokenloom's loader."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

_STACKED = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)")


def hf_blocks(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, out, in) float -> HF MXFP4 blocks (experts, out, in/32, 16) and scales (experts, out, in/32)."""
    raw = gguf.quants.quantize(matrix.float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    raw = raw.reshape(*matrix.shape[:-1], matrix.shape[-1] // 32, 17)
    scales, packed = raw[..., 0], raw[..., 1:]
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # (..., 32): GGML's byte j holds j, j + 16
    hf = values[..., 0::2] | (values[..., 1::2] << 4)  # HF's byte j holds 2j, 2j + 1
    return torch.from_numpy(np.ascontiguousarray(hf)), torch.from_numpy(np.ascontiguousarray(scales))


def write_mxfp4_folder(folder: Path, out: Path) -> Path:
    """A copy of the float gpt-oss `folder` at `out` with every expert matrix in MXFP4."""
    shutil.copytree(folder, out)
    state = load_file(str(folder / "model.safetensors"))
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if _STACKED.fullmatch(name):  # (experts, in, out) in HF's float layout
            converted[f"{name}_blocks"], converted[f"{name}_scales"] = hf_blocks(tensor.transpose(1, 2))
        else:
            converted[name] = tensor
    save_file(converted, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
