"""Keep freed activation memory in the process instead of handing it back to the OS.

glibc serves allocations above its mmap threshold (at most 32 MiB by default) with a
fresh ``mmap`` and unmaps them on free. A prefill step of a few thousand tokens
allocates several such tensors per layer (the gate/up projection of 6.7k tokens is
82 MB), so every layer touches hundreds of MB of new pages and pays a page fault,
and a zeroed page, per 4 KiB: measured on SmolLM2, ~20% of a 6.7k-token prefill.
Raising the mmap and trim thresholds makes such blocks come from (and go back to)
the heap, so the next step reuses pages that are already mapped. The cost is that
the resident size stays at the largest step's working set instead of shrinking
after it, as with the tcmalloc/jemalloc set-ups that CPU inference guides recommend.

Threads other than the main one allocate from their own arenas, whose heaps are at most
64 MiB: a larger block there is mmapped whatever the threshold. So the arena count is
capped at one, and this must run before the engine's thread first allocates (the async
engine applies it before starting that thread). Measured on a thread: 308k page faults
per four layer-sized steps by default, 147k with the thresholds alone, 0 with one arena.

A process-wide setting: it also serves any other torch code in the same process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("tokenloom")

_M_TRIM_THRESHOLD = -1     # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
KEEP_BELOW = 1 << 30       # blocks under 1 GiB come from the heap; larger ones (the KV cache) still mmap
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True where they are in force (glibc Linux).

    Off with TOKENLOOM_KEEP_FREED_MEMORY=0; a no-op elsewhere (other C libraries, macOS).
    """
    global _done
    if _done is None:
        _done = _apply()
    return _done


def _apply() -> bool:
    if os.environ.get("TOKENLOOM_KEEP_FREED_MEMORY") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):     # musl and friends have no mallopt
        return False
    ok = all(mallopt(param, value) == 1 for param, value in
             ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, KEEP_BELOW), (_M_TRIM_THRESHOLD, KEEP_BELOW)))
    if not ok:
        log.debug("mallopt refused the thresholds; freed activations go back to the OS")
    return ok
