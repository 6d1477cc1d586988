"""A GGUF file's metadata and tensor table, read straight from a memory map.

``gguf.GGUFReader`` builds a numpy view per metadata element, which is slow for a
262k-token vocabulary; this reader parses the header with ``struct`` (numeric arrays as one
``numpy.frombuffer``; a string array is walked past and decoded at its first use, so a look at
the chat template does not decode the vocabulary) and leaves tensor bytes in the map:
``GGUFTensorInfo.raw()`` is a zero-copy uint8 view of one tensor's bytes, read from disk
only when touched. Layout (GGUF v2/v3, little-endian): magic, version, tensor count, KV
count, KV pairs, tensor infos, padding to ``general.alignment``, tensor data.
"""

from __future__ import annotations

import mmap
import os
import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types -> struct format (scalars) / numpy dtype (arrays).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands."""


@dataclass(frozen=True, slots=True)
class _Strings:
    """Where a metadata string array lies in the header: `count` strings in bytes [pos, end)."""

    pos: int
    end: int
    count: int


class _Fields(dict):
    """Metadata key -> value, a string array decoded (by `decode`) the first time it is read."""

    def __init__(self, decode) -> None:
        super().__init__()
        self._decode = decode

    def __getitem__(self, key: str) -> object:
        value = super().__getitem__(key)
        if isinstance(value, _Strings):
            value = self._decode(value)
            super().__setitem__(key, value)
        return value

    def get(self, key: str, default: object = None) -> object:
        return self[key] if key in self else default  # noqa: SIM401  (self.get is this method)


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, ..., row length), i.e. GGUF's dims reversed
    type: int  # GGMLQuantizationType value
    offset: int  # bytes from the start of the file
    nbytes: int
    _buffer: mmap.mmap
    _file: _FileReads

    def raw(self) -> np.ndarray:
        """The tensor's bytes as a uint8 array viewing the file map (copy-on-write, no copy)."""
        return np.frombuffer(self._buffer, dtype=np.uint8, count=self.nbytes, offset=self.offset)

    def release_pages(self) -> None:
        """Drop this tensor's file pages from the process's memory (``release_map_pages``)."""
        release_map_pages(self._buffer, self.offset, self.nbytes)

    def read_rows(self, rows: Sequence[int], row_bytes: int) -> np.ndarray:
        """Rows `rows` of this tensor (`row_bytes` each) as a (len(rows), row_bytes) uint8 array read
        from the file, not through the map: no file page is mapped into the process, so an embedding
        looked up a few rows at a time never adds the kernel's 64 KiB read-around of each row to the
        resident size, not even for the moment of a lookup (its peak). IndexError for a row past the end."""
        count = self.nbytes // row_bytes
        out = np.empty((len(rows), row_bytes), dtype=np.uint8)
        for i, row in enumerate(rows):
            if not 0 <= row < count:
                raise IndexError(f"row {row} is out of range for {self.name}'s {count} rows")
            self._file.read_into(out[i], self.offset + row * row_bytes)
        return out


class _FileReads:
    """A read-only descriptor of the file, opened on first use, closed with its reader."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def read_into(self, buffer: np.ndarray, offset: int) -> None:
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            weakref.finalize(self, os.close, self.fd)
        if os.preadv(self.fd, [buffer], offset) != buffer.nbytes:  # type: ignore[list-item]  # numpy: a buffer
            raise OSError(f"{self.path} ended inside a tensor (truncated since it was opened?)")


def release_map_pages(file_map: mmap.mmap, start: int, length: int) -> None:
    """Drop the file pages of bytes [start, start + length) of `file_map` from this process's memory:
    views of them read them again (from the page cache) when touched. The map is copy-on-write and
    nothing writes to it, so no page dropped holds a change."""
    end = min(len(file_map), start + length)
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        file_map.madvise(mmap.MADV_DONTNEED, first, end - first)


class GGUFReader:
    """Metadata (``fields``: key -> Python value) and tensor infos (``tensors``) of a GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = _FileReads(self.path)
        with self.path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as e:
            raise GGUFFormatError(f"truncated or corrupt GGUF header at byte {self._pos}: {e}") from e
        release_map_pages(self._map, 0, self._pos)  # the header is parsed (a vocabulary's strings: ~5 MB)

    def _parse(self) -> None:
        if self._read(4) != GGUF_MAGIC:
            raise GGUFFormatError("no GGUF magic bytes")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, object] = _Fields(self._decode_strings)
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(cast(int, self.fields.get("general.alignment", 32)))  # a GGUF integer field
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, offset, data_start) for name, dims, kind, offset in infos]

    def _tensor(self, name: str, dims: list[int], kind: int, offset: int, data_start: int) -> GGUFTensorInfo:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name!r} has unknown GGML type {kind}") from None
        count = int(np.prod(dims)) if dims else 1
        nbytes = count // block_values * block_bytes
        start = data_start + offset
        if start + nbytes > len(self._map):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file (truncated?)")
        return GGUFTensorInfo(name, tuple(reversed(dims)), kind, start, nbytes, self._map, self._file)

    def _read(self, n: int) -> bytes:
        if self._pos + n > len(self._map):
            raise GGUFFormatError(f"file ends at byte {len(self._map)} inside the header (truncated?)")
        out = self._map[self._pos : self._pos + n]
        self._pos += n
        return out

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._read(self._scalar("<Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int, nested: bool = False):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
            array = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
            self._pos += array.nbytes
            return array.tolist()
        if item == _STRING:
            strings = self._skip_strings(count)
            return self._decode_strings(strings) if nested else strings
        return [self._value(item, nested=True) for _ in range(count)]

    def _skip_strings(self, count: int) -> _Strings:
        """Walk past `count` strings (their lengths only): where they lie."""
        start, pos, end = self._pos, self._pos, len(self._map)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            pos += 8 + unpack(self._map, pos)[0]
            if pos > end:
                raise GGUFFormatError(f"file ends at byte {end} inside a string array (truncated?)")
        self._pos = pos
        return _Strings(start, pos, count)

    def _decode_strings(self, strings: _Strings) -> list[str]:
        buf, pos, out = self._map, strings.pos, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(strings.count):
            (n,) = unpack(buf, pos)
            out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        release_map_pages(buf, strings.pos, strings.end - strings.pos)  # read again, dropped again
        return out

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
        return name, dims, self._scalar("<I"), self._scalar("<Q")
