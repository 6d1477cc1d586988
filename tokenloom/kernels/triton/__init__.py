"""Triton kernels for the CUDA path: paged attention over the block table, RMSNorm (with the
residual add), rope + KV-cache write, silu(gate) * up.

Each kernel's Python wrapper takes torch tensors and launches on their device. They run on a
CUDA device, and on the CPU under ``TRITON_INTERPRET=1`` (set before triton is imported): the
tests check every kernel against its torch reference that way, on machines without a GPU.
Triton is imported only by these modules, so the package works without it on a CPU.
"""

from __future__ import annotations

import os

import torch

_importable: bool | None = None


def importable() -> bool:
    """triton imports here (checked once)."""
    global _importable
    if _importable is None:
        try:
            import triton  # noqa: F401

            _importable = True
        except ImportError:
            _importable = False
    return _importable


def usable(x: torch.Tensor) -> bool:
    """The Triton kernels run on x's device: a CUDA tensor with triton installed, unless
    TOKENLOOM_NO_TRITON=1 (the torch ops then run, for comparison or where a kernel misbehaves)."""
    return x.is_cuda and os.environ.get("TOKENLOOM_NO_TRITON", "") != "1" and importable()


def takes_cache(kv_cache) -> bool:
    """The Triton attention path runs over `kv_cache` (a PagedKVCache): on a GPU, keys and values
    stored in the compute dtype (an int8 cache takes the torch path)."""
    keys = kv_cache.keys[kv_cache.layers[0]]
    return isinstance(keys, torch.Tensor) and usable(keys)


def interpreted() -> bool:
    """Kernels run in Triton's interpreter (on the CPU), not compiled."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
