"""Zero-filled CPU tensors whose pages the OS hands out only as they are written.

A KV cache is sized for the whole context (8,192 tokens for the default model: 0.35 GiB), and a
short run writes a few of its blocks. ``torch.zeros`` writes every byte at start-up (a memset of
the whole cache, and all of it resident); an anonymous private map reads as zero from the
start and takes a page from the OS at its first write. The pages are 4 KiB (not marked for huge
pages): a first write into a 2 MiB huge page would zero all of it, as much work per KV tensor as
the memset it saves.
"""

from __future__ import annotations

import mmap

import torch


def zeros_on(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros on `device`: on the CPU a lazy_zeros map (resident only where written), else torch.zeros."""
    if device.type == "cpu":
        return lazy_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous map of its own, resident only where written."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=dtype).view(shape)  # holds the map for as long as it lives
