"""MXFP4 (OCP microscaling FP4): 32 values per block, each a 4-bit e2m1 float
(0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), times one power-of-two scale 2^(e - 127)
stored as a byte e (e8m0). gpt-oss ships its expert weights so.

GGML's MXFP4 block (17 bytes) is the scale byte, then 16 bytes whose byte j holds value j (low
nibble) and value j + 16 (high nibble); its kernels read the nibbles as doubled values (0, 1, 2,
3, 4, 6, 8, 12, ...) times 2^(e - 128), the same numbers. HF's checkpoints keep blocks
(..., 32-value groups, 16 bytes) whose byte j holds values 2j (low) and 2j + 1 (high), and the
scales beside them (..., groups); ``from_hf_blocks`` re-lays them as GGML's.
"""

from __future__ import annotations

import torch

from tokenloom.quant.gguf.tensor import GGMLTensor

MXFP4 = 39  # GGML type id


def ggml_bytes(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF blocks (..., G, 16) uint8 and scales (..., G) uint8 -> GGML MXFP4 rows (..., G * 17)."""
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up")
    blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # (..., G, 32) codes in order
    packed = values[..., :16] | (values[..., 16:] << 4)  # (..., G, 16): GGML's nibble order
    return torch.cat((scales[..., None], packed), dim=-1).flatten(-2)  # (..., G * 17)


def from_hf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> list[GGMLTensor]:
    """An HF MXFP4 expert stack, blocks (experts, rows, G, 16) and scales (experts, rows, G), as one
    GGML MXFP4 tensor (rows, G * 32) per expert."""
    rows = ggml_bytes(blocks, scales)  # (experts, rows, G * 17)
    in_features = blocks.shape[-2] * 32
    return [GGMLTensor(MXFP4, rows[e], in_features) for e in range(rows.shape[0])]
