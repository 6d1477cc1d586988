"""A loaded model's weights moved into memory backed by 2 MiB pages (transparent huge pages).

Batch-1 decode streams every weight from memory once a step. In 4 KiB pages that is a TLB
miss every 4 KiB, each a page walk, and under a hypervisor a two-level one; in 2 MiB pages
the whole model is a few dozen TLB entries, and a decode step's weight-streaming products run
measurably faster (docs/BENCHMARKS.md, 'Measurements behind design choices').

Linux grants such pages to ranges marked ``MADV_HUGEPAGE`` when transparent huge pages are
"always" or "madvise" (the usual default); with "never", or off Linux, nothing moves.
``TOKENLOOM_HUGE_PAGES=0`` turns it off (for A/B runs).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import sys
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenloom.memory.allocator import libc, release_free_memory

log = logging.getLogger("tokenloom")

HUGE_PAGE = 2 << 20
MIN_BYTES = 64 << 10  # smaller storages (norm weights, biases) stay where they are
_ALIGN = 64  # each storage starts on a cache line in the arena
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def available() -> bool:
    """Huge pages can be had for a marked range here (Linux, THP "always" or "madvise", not turned off)."""
    if (
        os.environ.get("TOKENLOOM_HUGE_PAGES") == "0"
        or not sys.platform.startswith("linux")
        or not hasattr(mmap, "MADV_HUGEPAGE")
    ):
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter, buffer and module-held weight tensor (``held_tensors()``: GGUF panels), once."""
    seen: dict[int, torch.Tensor] = {}
    for m in model.modules():
        held = m.held_tensors() if hasattr(m, "held_tensors") else []  # type: ignore[operator]  # torch: Module attrs
        for t in [*m._parameters.values(), *m._buffers.values(), *held]:
            if isinstance(t, torch.Tensor):
                seen.setdefault(id(t), t)
    return list(seen.values())


def movable(t: torch.Tensor) -> bool:
    """A CPU tensor in memory torch allocated (a resizable storage: not a view of a file map or of
    a numpy array, not oneDNN's opaque blocked layout), large enough to be worth moving."""
    return (
        t.device.type == "cpu"
        and not t.is_mkldnn
        and t.untyped_storage().resizable()
        and t.untyped_storage().nbytes() >= MIN_BYTES
    )


def move_to_huge_pages(model: nn.Module, trim_every: int = 16 << 20) -> int:
    """Copy the model's movable weight storages into one arena marked for huge pages and point
    every tensor that used them at its copy (``Tensor.set_``: the same tensor objects, so kernels
    bound to them and tapes holding them see the move). Returns the bytes moved (0: nothing).

    An old storage that nothing else holds gives back its pages as they are copied (without
    that, a 0.5B model's 145 MB head raised the load's peak by as much), each is freed as its
    tensors leave it, and the heap's free pages go back every `trim_every` bytes: the peak stays
    near the weights plus `trim_every`."""
    if not available():
        return 0
    groups = _by_storage(t for t in model_tensors(model) if movable(t))
    total = sum(_aligned(storage.nbytes()) for storage, _ in groups.values())
    if total < HUGE_PAGE:
        return 0
    arena, base = _arena(total)
    offset = since_trim = 0
    with torch.no_grad():
        for key in list(groups):
            storage, tensors = groups.pop(key)
            nbytes = storage.nbytes()
            region = arena[base + offset : base + offset + nbytes]
            _copy(storage, region, trim_every, discard=_held_only_by(storage, tensors))
            del storage  # the tensors hold the old storage now, and no more
            for t in tensors:
                start = (base + offset) // t.element_size() + t.storage_offset()
                t.set_(region.untyped_storage(), start, t.size(), t.stride())
            offset += _aligned(nbytes)
            since_trim += nbytes
            if since_trim >= trim_every:
                release_free_memory()
                since_trim = 0
    release_free_memory()
    log.debug("moved %.1f MB of weights into 2 MiB pages", offset / 1e6)
    return offset


def _held_only_by(storage: torch.UntypedStorage, tensors: list[torch.Tensor]) -> bool:
    """No tensor but `tensors` uses `storage` (its use count: theirs and this handle's)."""
    return torch._C._storage_Use_Count(storage._cdata) == len(tensors) + 1


def _copy(storage: torch.UntypedStorage, region: torch.Tensor, piece: int, discard: bool) -> None:
    """region[:] = the storage's bytes, `piece` bytes at a time; with `discard`, each piece's whole
    pages of the old storage handed back to the OS once copied (nothing reads them again)."""
    source = torch.empty(0, dtype=torch.uint8).set_(storage)
    for start in range(0, source.numel(), piece):
        stop = min(source.numel(), start + piece)
        region[start:stop].copy_(source[start:stop])
        if discard:
            _discard_pages(source.data_ptr() + start, stop - start)


def _discard_pages(address: int, nbytes: int) -> None:
    """madvise(MADV_DONTNEED) the whole pages inside [address, address + nbytes)."""
    page = mmap.PAGESIZE
    first = -(-address // page) * page
    count = (address + nbytes - first) // page * page
    if count > 0:
        libc().madvise(first, count, mmap.MADV_DONTNEED)


def _by_storage(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]]:
    """Tensors grouped by the storage they view (a tied weight, the views of one fused buffer)."""
    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        groups.setdefault(storage.data_ptr(), (storage, []))[1].append(t)
    return groups


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _arena(nbytes: int) -> tuple[torch.Tensor, int]:
    """An anonymous map of at least `nbytes` marked for huge pages, as a uint8 tensor, and the
    offset of its first 2 MiB boundary (a huge page covers only a whole, aligned 2 MiB)."""
    # private: mmap.mmap(-1, n) alone maps shared memory (shmem), which THP's "enabled" does not cover
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(region, dtype=torch.uint8)  # holds the map for as long as it lives
    return arena, -arena.data_ptr() % HUGE_PAGE


class WeightArena:
    """One anonymous map marked for huge pages that a load's weight buffers are cut from, in
    order: buffers written as the weights load (GGUF blocks re-laid as panels) land in 2 MiB
    pages at once, and ``move_to_huge_pages`` has nothing to copy for them (a view of the map is
    not ``movable``). Pages past what was cut are never touched, so a generous `capacity` costs
    address space only."""

    def __init__(self, capacity: int) -> None:
        self.arena, self.base = _arena(capacity)
        self.used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized tensor cut from the arena; None where it no longer fits."""
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start = self.base + self.used
        if start + size > self.arena.numel():
            return None
        self.used += _aligned(size)
        return self.arena[start : start + size].view(dtype).view(shape)


# the arena of the load in progress (load_model), innermost last; None: outside_arena
_current: list[WeightArena | None] = []


@contextlib.contextmanager
def weight_arena(capacity: int) -> Iterator[None]:
    """Within: ``empty`` cuts buffers from a fresh WeightArena of `capacity` bytes where huge
    pages can be had (else it is torch.empty)."""
    if not available() or capacity < HUGE_PAGE:
        yield
        return
    _current.append(WeightArena(capacity))
    try:
        yield
    finally:
        _current.pop()


@contextlib.contextmanager
def outside_arena() -> Iterator[None]:
    """Within: ``empty`` takes from the heap even during a load, for buffers that are only a part of
    a weight (joined to its other parts by ``cat``, which takes the arena again): the heap gets a
    part back once joined, the arena would hold it to the end."""
    _current.append(None)
    try:
        yield
    finally:
        _current.pop()


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor: from the current load's arena (``weight_arena``) while it has
    room, else torch.empty."""
    if _current and _current[-1] is not None and (t := _current[-1].empty(shape, dtype)) is not None:
        return t
    return torch.empty(shape, dtype=dtype)


def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.cat([a, b]) along the first dimension, into a buffer from ``empty``."""
    joined = empty((a.shape[0] + b.shape[0], *a.shape[1:]), a.dtype)
    joined[: a.shape[0]], joined[a.shape[0] :] = a, b
    return joined
