"""Quantized KV-cache layers: keys (or values) stored in fewer bits, quantized as they are written
and dequantized as blocks are read, so attention's readers are the same as for a plain tensor.

- ``Int8Cache`` (``kv_cache_dtype="int8"``): symmetric int8, one float32 scale per (slot, kv head):
  ``x ~= q * s`` with ``s = max|x| / 127``.
- ``Int4Cache`` (``kv_cache_dtype="int4"``): llama.cpp's q4_0 per group of 32 elements of a head:
  ``d = m / -8`` where m is the group's element of largest magnitude (sign kept), codes
  ``q = min(15, trunc(x / d + 8.5))`` in 4 bits, ``x ~= (q - 8) d``; d stored as float16. Two codes
  a byte (element 2i in the low nibble, 2i + 1 in the high one): 18 bytes per 32 elements.
- ``HalfCache`` (``kv_cache_dtype="float16"`` or ``"bfloat16"``): each element rounded to 16 bits
  (llama.cpp's default f16 cache), no scales; a float32 model reads them widened back exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP = 32  # elements per q4_0 group (head_dim must be a multiple)


HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # kv_cache_dtype -> HalfCache storage
STORED_DTYPES = ("int8", "int4", *HALF_DTYPES)  # kv_cache_dtype values a QuantizedKV layer stores


def quantized_bytes_per_element_row(kv_cache_dtype: str, head_dim: int) -> int:
    """Bytes one (token, kv head) row of `head_dim` takes in a quantized cache, scales included."""
    if kv_cache_dtype in HALF_DTYPES:
        return head_dim * 2
    if kv_cache_dtype == "int8":
        return head_dim + 4  # int8 codes + one float32 scale
    if kv_cache_dtype == "int4":
        return head_dim // 2 + head_dim // INT4_GROUP * 2  # two codes a byte + a float16 per group
    raise ValueError(f"not a quantized KV cache dtype: {kv_cache_dtype!r}")


@dataclass
class QuantizedKV:
    """What every quantized layer holds: codes and their scales, both indexed by block first, and
    the dtype reads dequantize to; block copies and clears move both."""

    data: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """The logical shape: (num_blocks + 1, block_size, kv_heads, head_dim)."""
        raise NotImplementedError

    def store(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x (T, kv_heads, head_dim) into flat slots (T,) (in place)."""
        raise NotImplementedError

    def __getitem__(self, blocks: torch.Tensor) -> torch.Tensor:
        """Dequantized blocks: (*blocks.shape, block_size, kv_heads, head_dim) in ``dtype``."""
        raise NotImplementedError

    def copy_blocks_(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.data[dst] = self.data[src]
        self.scales[dst] = self.scales[src]

    def index_fill_(self, dim: int, index: torch.Tensor, value: float) -> None:
        """Blocks that read as zero (codes and scales 0)."""
        self.data.index_fill_(dim, index, 0)
        self.scales.index_fill_(dim, index, 0)


@dataclass
class Int8Cache(QuantizedKV):
    """One layer's keys (or values) as int8 (module doc): data (num_blocks + 1, block_size,
    kv_heads, head_dim) int8, scales (num_blocks + 1, block_size, kv_heads) float32."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def store(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x (T, kv_heads, head_dim) into flat slots (T,) (in place)."""
        n, bs, heads, dim = self.data.shape
        x32 = x.float()
        scale = x32.abs().amax(-1) / 127.0  # (T, kv_heads)
        q = torch.round(x32 / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-127, 127)
        self.data.view(n * bs, heads, dim).index_copy_(0, slots, q.to(torch.int8))
        self.scales.view(n * bs, heads).index_copy_(0, slots, scale)

    def __getitem__(self, blocks: torch.Tensor) -> torch.Tensor:
        """Dequantized blocks: data[blocks] -> (*blocks.shape, block_size, kv_heads, head_dim)."""
        flat = blocks.reshape(-1)
        data = self.data.index_select(0, flat).view(*blocks.shape, *self.data.shape[1:])
        scales = self.scales.index_select(0, flat).view(*blocks.shape, *self.scales.shape[1:])
        return data.to(self.dtype) * scales.to(self.dtype)[..., None]


@dataclass
class Int4Cache(QuantizedKV):
    """One layer's keys (or values) as q4_0 groups (module doc): data (num_blocks + 1, block_size,
    kv_heads, head_dim // 2) uint8, two codes a byte; scales (..., head_dim // 32) float16."""

    @staticmethod
    def allocate(shape: tuple[int, ...], dtype: torch.dtype, zeros) -> Int4Cache:
        """A cache of logical `shape` (blocks, block_size, kv_heads, head_dim); `zeros(size, dtype)`
        allocates. ValueError unless head_dim is a multiple of the group."""
        *lead, head_dim = shape
        if head_dim % INT4_GROUP:
            raise ValueError(f"an int4 KV cache needs head_dim a multiple of {INT4_GROUP}, got {head_dim}")
        codes = zeros((*lead, head_dim // 2), torch.uint8)
        return Int4Cache(codes, zeros((*lead, head_dim // INT4_GROUP), torch.float16), dtype)

    @property
    def shape(self) -> torch.Size:
        """The logical shape: (num_blocks + 1, block_size, kv_heads, head_dim)."""
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))

    def store(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x (T, kv_heads, head_dim) into flat slots (T,) (in place)."""
        T, heads, dim = x.shape
        groups = x.float().reshape(T, heads, dim // INT4_GROUP, INT4_GROUP)
        at = groups.abs().argmax(-1, keepdim=True)
        d = (groups.gather(-1, at) / -8.0).to(torch.float16)  # (T, heads, groups, 1), stored rounded
        d32 = d.float()
        inverse = torch.where(d32 != 0, 1.0 / d32, torch.zeros_like(d32))
        q = torch.trunc(groups * inverse + 8.5).clamp_(0, 15).to(torch.uint8).reshape(T, heads, dim)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)  # (T, heads, dim // 2)
        n, bs = self.data.shape[:2]
        self.data.view(n * bs, heads, dim // 2).index_copy_(0, slots, packed)
        self.scales.view(n * bs, heads, dim // INT4_GROUP).index_copy_(0, slots, d.squeeze(-1))

    def __getitem__(self, blocks: torch.Tensor) -> torch.Tensor:
        """Dequantized blocks: (*blocks.shape, block_size, kv_heads, head_dim) in ``dtype``."""
        flat = blocks.reshape(-1)
        packed = self.data.index_select(0, flat)  # (nb, bs, heads, dim // 2)
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # (nb, bs, heads, dim)
        d = self.scales.index_select(0, flat).to(self.dtype)  # (nb, bs, heads, groups)
        grouped = (codes.to(self.dtype) - 8).unflatten(-1, (d.shape[-1], INT4_GROUP)) * d[..., None]
        return grouped.flatten(-2).view(*blocks.shape, *self.shape[1:])


@dataclass
class HalfCache(QuantizedKV):
    """One layer's keys (or values) rounded to 16 bits (module doc): data (num_blocks + 1,
    block_size, kv_heads, head_dim) float16 or bfloat16; scales (num_blocks + 1, 0), empty (block
    copies and clears move them with the data, as for the other layers)."""

    @staticmethod
    def allocate(shape: tuple[int, ...], storage: torch.dtype, dtype: torch.dtype, zeros) -> HalfCache:
        """A cache of `shape` stored as `storage`, read as `dtype`; `zeros(size, dtype)` allocates."""
        return HalfCache(zeros(shape, storage), zeros((shape[0], 0), storage), dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def store(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Round x (T, kv_heads, head_dim) into flat slots (T,) (in place)."""
        n, bs, heads, dim = self.data.shape
        self.data.view(n * bs, heads, dim).index_copy_(0, slots, x.to(self.data.dtype))

    def __getitem__(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks widened: data[blocks] -> (*blocks.shape, block_size, kv_heads, head_dim) in ``dtype``."""
        return self.data[blocks].to(self.dtype)


QUANTIZED_CACHES = (QuantizedKV,)  # for isinstance: every quantized layer


def write_cache(cache, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter x (T, kv_heads, head_dim) into one layer's cache slots (T,) (in place): a tensor of
    the compute dtype, or a quantized layer (quantized on write)."""
    if isinstance(cache, QUANTIZED_CACHES):
        cache.store(slot_mapping, x)
    else:
        num_blocks, block_size, kv_heads, head_dim = cache.shape
        cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, x)


def copy_cache_blocks(cache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src -> dst (block ids (n,) each) in one layer's cache, of either kind."""
    if isinstance(cache, QUANTIZED_CACHES):
        cache.copy_blocks_(src, dst)
    else:
        cache[dst] = cache[src]


def allocate_stored(kv_cache_dtype: str, shape: tuple[int, ...], dtype: torch.dtype, zeros) -> QuantizedKV:
    """One layer's keys (or values) of logical `shape` (blocks, block_size, kv_heads, head_dim) in
    stored format `kv_cache_dtype` (one of STORED_DTYPES), read as `dtype`; `zeros(size, dtype)`
    allocates. ValueError for any other format."""
    if kv_cache_dtype == "int8":
        return Int8Cache(zeros(shape, torch.int8), zeros(shape[:3], torch.float32), dtype)
    if kv_cache_dtype == "int4":
        return Int4Cache.allocate(shape, dtype, zeros)
    if kv_cache_dtype in HALF_DTYPES:
        return HalfCache.allocate(shape, HALF_DTYPES[kv_cache_dtype], dtype, zeros)
    raise ValueError(f"not a stored KV cache format: {kv_cache_dtype!r} (one of {', '.join(STORED_DTYPES)})")
