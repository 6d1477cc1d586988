"""Zero-filled tensors taken from the OS page by page as written (tokenloom/memory/zero_pages.py)."""

from __future__ import annotations

import torch

from tests.memory.test_huge_pages import smaps_of
from tokenloom.memory.zero_pages import lazy_zeros


def test_lazy_zeros_are_zero_and_take_memory_only_where_written():
    """A 256 MiB KV-cache-like buffer: zero everywhere, resident only in the pages written."""
    t = lazy_zeros((64, 1 << 20), torch.float32)  # 256 MiB
    assert t.shape == (64, 1 << 20) and t.dtype == torch.float32

    def resident_kb() -> int:  # of the map holding t (the kernel may join neighbouring maps to it)
        return int(smaps_of(t.data_ptr())["Rss"].split()[0])

    before = resident_kb()
    assert before < 64 << 10  # not the 256 MiB
    t[3, :1024] = 7.0
    assert float(t[3, :1024].sum()) == 7.0 * 1024
    assert not t[3, 1024:].any() and not t[:3].any() and not t[-1].any()  # reads see zeros
    assert resident_kb() - before <= 8  # kB: the 4 KiB written (two pages at most)
    empty = lazy_zeros((0, 16, 2, 64), torch.float16)
    assert empty.shape == (0, 16, 2, 64)
