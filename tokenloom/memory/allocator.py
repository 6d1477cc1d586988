"""Keep freed activation memory in the process instead of handing it back to the OS.

glibc serves allocations above its mmap threshold (at most 32 MiB by default) with a
fresh ``mmap`` and unmaps them on free. A prefill step of a few thousand tokens
allocates several such tensors per layer (the gate/up projection of 6.7k tokens is
82 MB), so every layer touches hundreds of MB of new pages and pays a page fault,
and a zeroed page, per 4 KiB: a sizeable share of a long prefill (docs/BENCHMARKS.md,
'Measurements behind design choices').
Raising the mmap and trim thresholds makes such blocks come from (and go back to)
the heap, so the next step reuses pages that are already mapped. The cost is that
the resident size stays at the largest step's working set instead of shrinking
after it, as with the tcmalloc/jemalloc set-ups that CPU inference guides recommend.

Threads other than the main one allocate from their own arenas, whose heaps are at most
64 MiB: a larger block there is mmapped whatever the threshold. So the arena count is
capped at one, and this must run before the engine's thread first allocates (the async
engine applies it before starting that thread). On a thread, the thresholds alone left about
half of the default's page faults, one arena none.

A process-wide setting: it also serves any other torch code in the same process.

The first step of a new, larger size still grows the heap into fresh pages, and is slower than
the same step again by the cost of their page faults. ``reserve_heap`` pays that once at start-up
instead, and in 2 MiB pages where the kernel grants them (far faster than in 4 KiB pages).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger("tokenloom")

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20
KEEP_BELOW = 1 << 30  # blocks under 1 GiB come from the heap; larger ones (the KV cache) still mmap
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True where they are in force (glibc Linux).

    Off with TOKENLOOM_KEEP_FREED_MEMORY=0; a no-op elsewhere (other C libraries, macOS).
    """
    global _done
    if _done is None:
        _done = _apply()
    return _done


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library (raises OSError where there is none to load); found once (find_library runs
    ldconfig in a subprocess on every call), with the pointer-taking calls used here declared:
    malloc, free, madvise."""
    c = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    c.malloc.restype = ctypes.c_void_p
    c.malloc.argtypes = [ctypes.c_size_t]
    c.free.argtypes = [ctypes.c_void_p]
    c.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return c


def _apply() -> bool:
    if os.environ.get("TOKENLOOM_KEEP_FREED_MEMORY") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = libc().mallopt
    except (OSError, AttributeError):  # musl and friends have no mallopt
        return False
    ok = all(
        mallopt(param, value) == 1
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, KEEP_BELOW), (_M_TRIM_THRESHOLD, KEEP_BELOW))
    )
    if not ok:
        log.debug("mallopt refused the thresholds; freed activations go back to the OS")
    return ok


def reserve_heap(nbytes: int) -> bool:
    """Grow malloc's heap by `nbytes` now, touched (in 2 MiB pages where transparent huge
    pages are allowed), and leave it free for the activations of later steps; True if done.

    Needs keep_freed_memory() in force (else the freed block goes straight back to the OS),
    and nbytes under its KEEP_BELOW (a larger block would be mmapped on its own).
    """
    if not keep_freed_memory() or not 0 < nbytes < KEEP_BELOW:
        return False
    c = libc()
    block = c.malloc(nbytes)
    if not block:
        return False
    start = -(-block // _HUGE_PAGE) * _HUGE_PAGE  # the whole 2 MiB pages inside the block
    whole = (block + nbytes - start) // _HUGE_PAGE * _HUGE_PAGE
    if whole > 0:
        c.madvise(start, whole, _MADV_HUGEPAGE)  # a hint: refused or ignored is fine
    ctypes.memset(block, 0, nbytes)
    c.free(block)
    return True


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the OS now (glibc ``malloc_trim``): after loading,
    whose temporaries the thresholds above would otherwise keep resident. True if done."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False
