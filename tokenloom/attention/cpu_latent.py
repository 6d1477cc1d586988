"""Decode attention over a latent cache (DeepSeek's MLA) through a compiled CPU kernel
(``csrc/latent_decode_cpu.cpp``): each decoding sequence's keys read in place through its block
table, tile by tile with an online softmax, every query head of a task against each key row it
loads; no gathered copy of the context, and the same arithmetic alone or batched."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.attention import cpu_decode
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kernels import native

_SOURCE = Path(__file__).parent / "csrc" / "latent_decode_cpu.cpp"


def build() -> bool:
    """Compile and register the kernel (once per process); False where it cannot be."""
    return native.load(_SOURCE, "latent decode attention kernel")


def usable(q: torch.Tensor, k_cache, value_dim: int) -> bool:
    """The kernel takes this step: float32 on the CPU, key and value dims multiples of 8, and it compiled."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and isinstance(k_cache, torch.Tensor)
        and k_cache.dtype == torch.float32
        and q.shape[-1] % 8 == 0
        and value_dim % 8 == 0
        and build()
    )


def attend(
    q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float, value_dim: int, window: int | None
) -> torch.Tensor:
    """q (S, heads, D): the query of each decoding sequence (cpu_decode.decode_rows) ->
    (S, heads, value_dim), each attending to its last `window` positions (None: all)."""
    tables, ctx = cpu_decode.decode_inputs(meta)
    return torch.ops.tokenloom_latent.latent_decode(q.contiguous(), k_cache, tables, ctx, scale, value_dim, window or 0)
