"""What a server may serve and when its models load and unload: the catalog's entries and the
load policy (read by serve's flags on every command, so nothing heavy is imported here)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MEMORY_SHARE = 0.8  # of the machine's memory, the loaded models' default budget


@dataclass(frozen=True)
class ModelEntry:
    """A model the server can serve: the names a request may use and where it loads from."""

    name: str  # the name listings show first
    source: str  # what the loader takes: a path, a pulled model's name or a Hub name
    aliases: tuple[str, ...] = ()
    size_bytes: int = 0  # its weights on disk

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def weights_size(path: str | Path) -> int:
    """Bytes of a model's weights on disk: a GGUF file's size, or an HF folder's safetensors."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else 0


def physical_memory() -> int:
    """The machine's memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass(frozen=True)
class LoadPolicy:
    """When models load and unload (the module doc)."""

    keep_alive_s: float = 300.0  # idle time before a model is unloaded; negative: never
    max_loaded: int = 3  # models loaded at once, at most
    memory_bytes: int | None = None  # their weights and KV caches at most; None: MEMORY_SHARE of RAM
    load_timeout_s: float = 300.0  # how long a request waits for its model's load
    kv_bound_bytes: int = 1 << 30  # the KV cache a model not yet loaded is counted with

    def __post_init__(self) -> None:
        if self.max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1 (got {self.max_loaded})")
        if self.load_timeout_s <= 0:
            raise ValueError(f"load_timeout_s must be positive (got {self.load_timeout_s})")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive (got {self.memory_bytes})")

    @property
    def budget(self) -> int:
        return self.memory_bytes if self.memory_bytes is not None else int(MEMORY_SHARE * physical_memory())


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_seconds(value: str | int | float) -> float:
    """A keep-alive in seconds: a number of seconds or a Go duration as ollama takes it ("5m",
    "1h30m", "300ms", "-1"); negative: keep loaded, 0: unload once idle. ValueError otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
    parts = _DURATION_PART.findall(body)
    if not body or not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"{value!r} is not a duration (seconds, or like 5m, 1h30m, -1)")
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
