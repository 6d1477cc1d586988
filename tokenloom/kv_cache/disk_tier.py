"""The prefix cache's disk tier: full KV blocks kept as files, found again by their token chain.

A block's key is a chained digest: sha256(the key of the block before it (the namespace for the
first), its token ids), so equal keys mean equal whole prefixes, in any process. The namespace
names what the bytes depend on besides the tokens: the model, the compute dtype, the cache's
format and block size (``namespace``); each namespace is its own folder.

Each block is one file, ``<dir>/<namespace>/<key[:2]>/<key>.kv``: a header (magic, payload length,
sha256 of the payload) then the payload, the bytes the KV cache wrote (PagedKVCache.block_bytes).
A file is written under a temporary name, flushed to disk, then renamed into place, so a reader
(in this process or another) sees a whole file or none; a file whose payload does not match its
header's digest (a crash mid-write on a filesystem without atomic rename, a disk error) is deleted
and read as a miss. The tier is bounded by ``max_bytes``: after a write, the least recently used
files (by modification time, which a hit refreshes) go until the rest fit.

Pure Python: the block manager asks ``contains`` while looking up a prompt, the engine reads and
writes the bytes around a step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from array import array
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"TLKV0001"
HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload


def namespace(*parts: object) -> str:
    """The folder name for blocks that depend on `parts` (model identity, dtype, format, block size)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def model_identity(path: str) -> tuple:
    """What names a model's weights without reading them: its path and each file's size and
    modification time (a folder's files, one level deep), so a changed file is another model."""
    root = Path(path)
    files = sorted(p for p in root.iterdir() if p.is_file()) if root.is_dir() else [root]
    return (str(root.resolve()), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def chain_key(parent: str, token_ids: tuple[int, ...] | list[int]) -> str:
    """The key of a block holding `token_ids` after the block keyed `parent` (the namespace first)."""
    return hashlib.sha256(parent.encode() + array("q", token_ids).tobytes()).hexdigest()


class DiskTier:
    """Full KV blocks as files under `directory`/`space`, at most `max_bytes` of them (module doc)."""

    def __init__(self, directory: str | os.PathLike, space: str, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the prefix cache's disk tier needs a positive size, got {max_bytes} bytes")
        self.root = Path(directory) / space
        self.root.mkdir(parents=True, exist_ok=True)
        self.space = space
        self.max_bytes = max_bytes
        self.hits = self.writes = self.corrupt = 0
        self._bytes = sum(p.stat().st_size for p in self._files())

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.kv"

    def _files(self) -> list[Path]:
        return [p for p in self.root.glob("*/*.kv") if p.is_file()]

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def get(self, key: str) -> bytes | None:
        """The block's payload, or None if it is not here or is damaged (then deleted)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        payload = self._check(data)
        if payload is None:
            self.corrupt += 1
            logger.warning("prefix cache: %s is damaged; deleted", path)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        self.hits += 1
        return payload

    @staticmethod
    def _check(data: bytes) -> bytes | None:
        if len(data) < HEADER.size:
            return None
        magic, length, digest = HEADER.unpack_from(data)
        payload = data[HEADER.size :]
        if magic != MAGIC or length != len(payload) or hashlib.sha256(payload).digest() != digest:
            return None
        return payload

    def put(self, key: str, payload: bytes) -> None:
        """Write the block (a no-op if it is already there), then keep the tier within its bound."""
        path = self._path(key)
        if path.is_file():
            return
        path.parent.mkdir(exist_ok=True)
        header = HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.writes += 1
        self._bytes += HEADER.size + len(payload)
        if self._bytes > self.max_bytes:
            self._shrink()

    def _shrink(self) -> None:
        """Delete the least recently used files until the rest fit in max_bytes (other processes'
        writes counted too: the sizes are read from the folder)."""
        files = []
        for p in self._files():
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        files.sort()
        total = sum(size for _, size, _ in files)
        for _, size, p in files:
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
        self._bytes = total
