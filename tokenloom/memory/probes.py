"""What the operating system says about memory (Linux /proc; portable fallbacks)."""

from __future__ import annotations

import os


def proc_kib_field(path: str, key: str) -> int | None:
    """Bytes of a 'Key:  N kB' line of a /proc file (None if absent or not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int:
    """Bytes of memory available to new allocations (MemAvailable on Linux)."""
    if (avail := proc_kib_field("/proc/meminfo", "MemAvailable")) is not None:
        return avail
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
